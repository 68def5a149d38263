//! Sending into another process's pool: [`PeerTransport`] moves each chunk from this rank's pool
//! into a decode pool mapped into this process ([`ImportedPool`](crate::ipc::ImportedPool)), so
//! both spaces are in the one backend address space and a chunk is a launch (or a copy-engine
//! call) of this process's GPU, with no staging and no network engine.
//!
//! Three executors, for comparison (BENCHMARKS.md):
//! - [`PeerMethod::Blocks`]: one `kvs_copy_blocks` launch per section (the chunk's latent KV;
//!   the final chunk adds the indexer state) from page lists, whatever the number of pages and
//!   layers: no descriptors at all;
//! - [`PeerMethod::CopyEngine`]: one `memcpy_batch` call over the coalesced ranges of the
//!   chunk's [`DescriptorBatch`](super::DescriptorBatch) (`cuMemcpyBatchAsync` over NVLink),
//!   which leaves every SM to the forward pass;
//! - [`PeerMethod::PerBlock`]: the naive baseline, one copy per (page, layer) block, as a
//!   transfer engine posting one descriptor per block does (on a GPU `cuMemcpyAsync` of the
//!   peer-mapped address, what `cudaMemcpyPeerAsync` does once the memory is mapped here).
//!
//! The plans are the in-process ones ([`SendPlan`]), with the same empty-final-chunk rule: a
//! rank that owns nothing of a chunk submits it all the same and the transport moves nothing.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::exec::{BackendTransport, CopyMethod};
use super::plan::SendPlan;
use super::stats::{Posted, TransferStats};
use super::transport::{Completion, Transport};
use crate::backend::{check_space, Backend, Event, Launch};
use crate::copy::space::sealed::Sealed as _;
use crate::copy::{BlockSpace, RemoteSpace};
use crate::error::Result;
use crate::index::StoredLayer;
use crate::lock::lock;
use crate::pool::DevicePool;

/// How a [`PeerTransport`] moves a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerMethod {
    /// One `kvs_copy_blocks` launch per section with this grid.
    Blocks(Launch),
    /// One copy-engine batch call over the chunk's coalesced ranges.
    CopyEngine,
    /// One copy-engine copy per (page, layer) block: the naive baseline.
    PerBlock,
}

impl fmt::Display for PeerMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Blocks(l) => write!(f, "one-launch kernel ({} CTAs x {})", l.ctas, l.threads),
            Self::CopyEngine => f.write_str("copy-engine batch"),
            Self::PerBlock => f.write_str("per-block copies"),
        }
    }
}

/// What a [`PeerTransport`] has submitted, summed over chunks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerStats {
    /// Chunks submitted (empty ones included).
    pub chunks: u64,
    /// Kernel launches.
    pub launches: u64,
    /// Copy-engine calls (batch calls, or single copies).
    pub copy_calls: u64,
    /// Address/length descriptors handed to the copy engine (ranges of batches, single copies).
    pub descriptors: u64,
    /// Bytes submitted.
    pub bytes: u64,
}

/// Executes chunks from this rank's pool into a peer-mapped destination, on one backend stream.
pub struct PeerTransport {
    backend: Arc<dyn Backend>,
    method: PeerMethod,
    /// The block and copy-engine executors (the per-block baseline needs neither).
    inner: BackendTransport,
    stats: Arc<Mutex<PeerStats>>,
    /// The counters every transport keeps ([`Transport::stats`]).
    transfer: TransferStats,
}

impl fmt::Debug for PeerTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerTransport")
            .field("backend", &self.backend.name())
            .field("method", &self.method)
            .finish_non_exhaustive()
    }
}

impl PeerTransport {
    /// A transport enqueuing on `backend` with `method`.
    pub fn new(backend: Arc<dyn Backend>, method: PeerMethod) -> Self {
        let inner_method = match method {
            PeerMethod::Blocks(launch) => CopyMethod::Blocks(launch),
            PeerMethod::CopyEngine | PeerMethod::PerBlock => CopyMethod::CopyEngine,
        };
        Self {
            inner: BackendTransport::with_method(backend.clone(), inner_method),
            backend,
            method,
            stats: Arc::default(),
            transfer: TransferStats::new("peer"),
        }
    }

    /// How this transport moves bytes.
    pub fn method(&self) -> PeerMethod {
        self.method
    }

    /// Counters of what it submitted, shared: they keep counting after the transport is handed
    /// to a [`Sender`](super::Sender).
    pub fn stats(&self) -> Arc<Mutex<PeerStats>> {
        self.stats.clone()
    }

    /// One copy per (page, layer) block of every non-empty section.
    fn per_block(
        &self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
    ) -> Result<u64> {
        plan.check_spaces(src.as_ref(), dst.as_ref())?;
        let space = self.backend.address_space();
        check_space(space, src.address_space(), "the source pool")?;
        check_space(space, dst.address_space(), "the destination")?;
        let mut copies = 0;
        let (reads, writes) = ([src.usage()], [dst.usage()]);
        crate::backend::ordered(self.backend.as_ref(), &reads, &writes, || {
            for section in plan.sections() {
                if section.is_empty() {
                    continue;
                }
                let owned = section.owned();
                for c in section.components() {
                    for layer in 0..c.layers {
                        for (&s, &d) in owned.src_pages().iter().zip(owned.dst_pages()) {
                            let from = src.block_addr(c.component, StoredLayer(layer), s)?;
                            let to = dst.block_addr(c.component, StoredLayer(layer), d)?;
                            // SAFETY: both blocks were checked inside their spaces
                            // (block_addr), which are in this backend's address space (checked
                            // above) and kept alive by their usages and the completion until
                            // the stream has passed the copy.
                            unsafe { self.backend.memcpy(to, from, c.item as usize)? };
                            copies += 1;
                        }
                    }
                }
            }
            Ok(())
        })?;
        Ok(copies)
    }
}

/// A chunk's completion: the stream event after its copies, and what they use.
struct PeerCompletion {
    backend: Arc<dyn Backend>,
    event: Event,
    _keep: (Arc<DevicePool>, Arc<RemoteSpace>),
}

impl Completion for PeerCompletion {
    fn poll(&mut self) -> Result<bool> {
        self.backend.is_done(&self.event)
    }

    fn wait_sync(&mut self) -> Result<()> {
        self.backend.wait_event_sync(&self.event)
    }
}

impl Transport for PeerTransport {
    fn submit(
        &mut self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
    ) -> Result<Box<dyn Completion>> {
        let started = Instant::now();
        let mut counted = PeerStats {
            chunks: 1,
            bytes: plan.bytes().total(),
            ..PeerStats::default()
        };
        let result = self.enqueue(plan, src, dst, &mut counted);
        let method = self.method;
        self.transfer.submitted(started, result, || {
            // The per-block baseline posts its copies; the others what a descriptor-based
            // engine would have posted for the plan.
            let descriptors = match method {
                PeerMethod::PerBlock => counted.descriptors,
                _ => plan.descriptor_count() as u64,
            };
            Some(Posted {
                bytes: counted.bytes,
                descriptors,
                post_time: started.elapsed(),
                bounced: false,
            })
        })
    }

    fn stats(&self) -> Option<TransferStats> {
        Some(self.transfer.clone())
    }
}

impl PeerTransport {
    /// Enqueues a chunk, counting it into `counted` and [`PeerTransport::stats`].
    fn enqueue(
        &mut self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
        counted: &mut PeerStats,
    ) -> Result<Box<dyn Completion>> {
        let completion: Box<dyn Completion> = match self.method {
            PeerMethod::PerBlock => {
                let copies = self.per_block(plan, src, dst)?;
                counted.copy_calls = copies;
                counted.descriptors = copies;
                Box::new(PeerCompletion {
                    event: self.backend.record()?,
                    backend: self.backend.clone(),
                    _keep: (src.clone(), dst.clone()),
                })
            }
            PeerMethod::Blocks(_) => {
                counted.launches = plan.sections().iter().filter(|s| !s.is_empty()).count() as u64;
                self.inner.submit(plan, src, dst)?
            }
            PeerMethod::CopyEngine => {
                let completion = self.inner.submit(plan, src, dst)?;
                // One range of the batch per descriptor of the plan (DescriptorBatch::resolve).
                counted.descriptors = plan.descriptor_count() as u64;
                counted.copy_calls = u64::from(counted.descriptors > 0);
                completion
            }
        };
        let mut stats = lock(&self.stats);
        stats.chunks += counted.chunks;
        stats.launches += counted.launches;
        stats.copy_calls += counted.copy_calls;
        stats.descriptors += counted.descriptors;
        stats.bytes += counted.bytes;
        Ok(completion)
    }
}
