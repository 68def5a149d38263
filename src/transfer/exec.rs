//! Executing send plans. A [`Transport`] moves one chunk's [`SendPlan`] from the sending rank's
//! pool into a destination ([`RemoteSpace`]) and hands back a [`Completion`] to poll or wait on;
//! nothing here waits unless asked.
//!
//! [`BackendTransport`] executes chunks whose source and destination live in one backend
//! address space (the same GPU, a peer-mapped pool, or the CPU reference's arena):
//! - [`CopyMethod::Blocks`] (the default): one `kvs_copy_blocks` launch per section from page
//!   lists; owned pages of a rank sit N apart on the decode side, so runs rarely coalesce, and
//!   page lists (16 bytes a page) keep the per-chunk upload far below the copy itself;
//! - [`CopyMethod::Kernel`]: one `kvs_copy_ranges` launch over the absolute ranges of a
//!   [`DescriptorBatch`], ranges longer than [`KERNEL_PIECE_BYTES`] split first;
//! - [`CopyMethod::CopyEngine`]: one `memcpy_batch` call over the same ranges, which leaves the
//!   SMs to the forward pass.
//!
//! A [`DescriptorBatch`] is also exactly what a network transfer engine moves (NIXL and
//! Mooncake register memory regions, then take lists of address/length pairs).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::plan::SendPlan;
use super::stats::{Posted, TransferStats};
use super::transport::{Completion, Transport};
use super::ComponentBytes;
use crate::abi;
use crate::backend::{Backend, Event, KernelFamily, Launch};
use crate::copy::{BlockCopyPlan, BlockSpace, PageSelection, RemoteSpace, TableStore};
use crate::error::Result;
use crate::pool::DevicePool;

/// Longest range one warp of `kvs_copy_ranges` copies: 64 iterations of the warp's 4 KB
/// (32 lanes x 8 loads of 16 bytes in flight). Short enough that a batch of coalesced runs
/// spreads over the whole grid, long enough that the per-range overhead stays negligible.
pub const KERNEL_PIECE_BYTES: u64 = 256 << 10;

/// `ranges` cut into consecutive pieces of at most [`KERNEL_PIECE_BYTES`], in order: the
/// table [`CopyMethod::Kernel`] launches over. Empty ranges yield no piece; addresses wrap
/// rather than panic (a range past the end of the address space is garbage in, garbage out).
pub fn kernel_pieces(ranges: &[abi::kvs_range]) -> impl Iterator<Item = abi::kvs_range> + '_ {
    ranges.iter().flat_map(|r| {
        (0..r.bytes.div_ceil(KERNEL_PIECE_BYTES)).map(move |k| {
            let offset = k * KERNEL_PIECE_BYTES;
            abi::kvs_range {
                src: r.src.wrapping_add(offset),
                dst: r.dst.wrapping_add(offset),
                bytes: (r.bytes - offset).min(KERNEL_PIECE_BYTES),
            }
        })
    })
}

/// A plan resolved against its source and destination: the absolute ranges to move, in the
/// plan's descriptor order, every one inside a (component, layer) buffer of its space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescriptorBatch {
    request: u64,
    rank: u32,
    chunk: u32,
    last: bool,
    ranges: Vec<abi::kvs_range>,
    bytes: ComponentBytes,
}

impl DescriptorBatch {
    /// Resolves `plan` against `src` (the sending rank's pool) and `dst` (the destination),
    /// after checking both hold what the plan moves ([`SendPlan::check_spaces`]).
    pub fn resolve(plan: &SendPlan, src: &dyn BlockSpace, dst: &dyn BlockSpace) -> Result<Self> {
        plan.check_spaces(src, dst)?;
        let mut ranges = Vec::with_capacity(plan.descriptor_count());
        for d in plan.descriptors() {
            let s = src.component_index(d.component)?;
            let t = dst.component_index(d.component)?;
            // In range: check_spaces bounded every run by both spaces' pages and layers.
            let (s0, t0) = (
                crate::copy::space::sealed::Sealed::base(src, s, d.layer),
                crate::copy::space::sealed::Sealed::base(dst, t, d.layer),
            );
            ranges.push(abi::kvs_range {
                src: s0 + d.src_offset,
                dst: t0 + d.dst_offset,
                bytes: d.bytes,
            });
        }
        let chunk = plan.chunk();
        Ok(Self {
            request: plan.request(),
            rank: plan.rank(),
            chunk: chunk.index,
            last: chunk.last,
            ranges,
            bytes: plan.bytes(),
        })
    }

    /// Request id.
    pub fn request(&self) -> u64 {
        self.request
    }

    /// The sending prefill rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Index of the chunk in the request's send order.
    pub fn chunk(&self) -> u32 {
        self.chunk
    }

    /// Whether this is the request's final chunk.
    pub fn is_last(&self) -> bool {
        self.last
    }

    /// The absolute ranges, in the plan's descriptor order.
    pub fn ranges(&self) -> &[abi::kvs_range] {
        &self.ranges
    }

    /// Whether the batch moves nothing (the rank still reports the chunk).
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Bytes the batch moves, per component.
    pub fn bytes(&self) -> ComponentBytes {
        self.bytes
    }
}

impl fmt::Display for DescriptorBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "request {} rank {} chunk {}{}: {} ranges, {}",
            self.request,
            self.rank,
            self.chunk,
            if self.last { " final" } else { "" },
            self.ranges.len(),
            self.bytes
        )
    }
}

/// The block copies of one plan: per non-empty section, the local source pages into the
/// destination pages of the section's components. What [`CopyMethod::Blocks`] launches, and
/// what a bounce-buffered transport packs.
pub fn block_copies(
    plan: &SendPlan,
    src: &dyn BlockSpace,
    dst: &dyn BlockSpace,
) -> Result<Vec<BlockCopyPlan>> {
    plan.check_spaces(src, dst)?;
    plan.sections()
        .into_iter()
        .filter(|s| !s.is_empty())
        .map(|section| {
            let owned = section.owned();
            let components: Vec<_> = section.components().iter().map(|c| c.component).collect();
            Ok(BlockCopyPlan::new(
                src,
                PageSelection::Local(owned.src_pages().to_vec()),
                dst,
                PageSelection::Local(owned.dst_pages().to_vec()),
                owned.len(),
            )?
            .only_components(src, &components))
        })
        .collect()
}

/// How a [`BackendTransport`] moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyMethod {
    /// One `kvs_copy_blocks` launch per section with this grid, from page lists: the smallest
    /// upload of the three.
    Blocks(Launch),
    /// One `kvs_copy_ranges` launch per chunk with this grid, ranges split into pieces of at
    /// most [`KERNEL_PIECE_BYTES`].
    Kernel(Launch),
    /// One `memcpy_batch` call per chunk (`cudaMemcpyBatchAsync` on the GPU).
    CopyEngine,
}

impl CopyMethod {
    /// The block executor with the grid kvshard picks for `backend`: 264 CTAs (two per H200
    /// SM) of 512 threads, measured at 91-95% of the device-to-device copy for 512+ page
    /// chunks (BENCHMARKS.md).
    pub fn default_for(backend: &dyn Backend) -> Self {
        Self::Blocks(Launch {
            ctas: 264,
            threads: backend.max_threads(KernelFamily::Copy).min(512),
        })
    }
}

/// A completion of in-process work: an event of the backend's stream (timed, with the timed
/// event recorded before the work, so the device time can be read), and what must stay alive
/// until the stream passes it.
struct StreamCompletion {
    backend: Arc<dyn Backend>,
    started: Option<Event>,
    event: Option<Event>,
    _keep: Vec<Arc<dyn BlockSpace>>,
}

impl Completion for StreamCompletion {
    fn poll(&mut self) -> Result<bool> {
        match &self.event {
            Some(e) => self.backend.is_done(e),
            None => Ok(true),
        }
    }

    fn wait_sync(&mut self) -> Result<()> {
        if let Some(e) = &self.event {
            self.backend.wait_event_sync(e)?;
        }
        Ok(())
    }

    fn transfer_time(&self) -> Option<Duration> {
        let (start, end) = (self.started.as_ref()?, self.event.as_ref()?);
        // Only a completed pair of timed events has an elapsed time (a deferred CPU backend's
        // have none): the caller falls back to the wall clock.
        let ms = self.backend.elapsed_ms(start, end).ok()?;
        Duration::try_from_secs_f64(ms / 1e3).ok()
    }
}

/// Executes chunks on a backend whose address space holds both the source and the
/// destination, in the backend's stream order.
pub struct BackendTransport {
    store: TableStore,
    method: CopyMethod,
    stats: TransferStats,
}

impl fmt::Debug for BackendTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendTransport")
            .field("backend", &self.store.backend().name())
            .field("method", &self.method)
            .finish_non_exhaustive()
    }
}

impl BackendTransport {
    /// A transport enqueuing on `backend` with the method kvshard picks
    /// ([`CopyMethod::default_for`]).
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        let method = CopyMethod::default_for(backend.as_ref());
        Self::with_method(backend, method)
    }

    /// A transport enqueuing on `backend` with `method`.
    pub fn with_method(backend: Arc<dyn Backend>, method: CopyMethod) -> Self {
        Self {
            store: TableStore::new(backend),
            method,
            stats: TransferStats::new("backend"),
        }
    }

    /// How this transport moves bytes.
    pub fn method(&self) -> CopyMethod {
        self.method
    }
}

impl Transport for BackendTransport {
    fn submit(
        &mut self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
    ) -> Result<Box<dyn Completion>> {
        let started = Instant::now();
        let result = self.enqueue(plan, src, dst);
        self.stats.submitted(started, result, || {
            Some(Posted {
                bytes: plan.bytes().total(),
                descriptors: plan.descriptor_count() as u64,
                post_time: started.elapsed(),
                bounced: false,
            })
        })
    }

    fn stats(&self) -> Option<TransferStats> {
        Some(self.stats.clone())
    }
}

impl BackendTransport {
    /// Enqueues `plan`'s copies; what [`Transport::submit`] times and counts.
    fn enqueue(
        &mut self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
    ) -> Result<Box<dyn Completion>> {
        let backend = self.store.backend().clone();
        let src_space: Arc<dyn BlockSpace> = src.clone();
        let dst_space: Arc<dyn BlockSpace> = dst.clone();
        if plan.is_empty() {
            plan.check_spaces(src_space.as_ref(), dst_space.as_ref())?;
            return Ok(Box::new(StreamCompletion {
                backend,
                started: None,
                event: None,
                _keep: Vec::new(),
            }));
        }
        let started = backend.record_timed()?;
        match self.method {
            CopyMethod::Blocks(launch) => {
                for copy in block_copies(plan, src_space.as_ref(), dst_space.as_ref())? {
                    self.store.launch(&copy, &src_space, &dst_space, launch)?;
                }
            }
            CopyMethod::Kernel(launch) => {
                let batch = DescriptorBatch::resolve(plan, src_space.as_ref(), dst_space.as_ref())?;
                let pieces: Vec<_> = kernel_pieces(batch.ranges()).collect();
                self.store
                    .launch_ranges(&pieces, [&src_space, &dst_space], launch)?;
            }
            CopyMethod::CopyEngine => {
                let batch = DescriptorBatch::resolve(plan, src_space.as_ref(), dst_space.as_ref())?;
                for space in [&src_space, &dst_space] {
                    crate::backend::check_space(
                        backend.address_space(),
                        space.address_space(),
                        "a transfer space",
                    )?;
                }
                let (from, to) = (src_space.usage(), dst_space.usage());
                crate::backend::ordered(backend.as_ref(), &[from], &[to], || {
                    // SAFETY: every range lies inside a (component, layer) buffer of the two
                    // spaces (DescriptorBatch::resolve checked every run against their pages,
                    // layers and blocks), which are in the backend's address space (checked
                    // above) and kept alive by their usages and the completion until the stream
                    // has passed the copies.
                    unsafe { backend.memcpy_batch(batch.ranges()) }
                })?;
            }
        }
        Ok(Box::new(StreamCompletion {
            started: Some(started),
            event: Some(backend.record_timed()?),
            backend,
            _keep: vec![src_space, dst_space],
        }))
    }
}
