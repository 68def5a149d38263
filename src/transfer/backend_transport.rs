//! Executing send plans. A [`Transport`] moves one chunk's [`SendPlan`] from the sending rank's
//! pool into a destination ([`RemoteSpace`]) and hands back a [`Completion`] to poll or wait on;
//! nothing here waits unless asked.
//!
//! [`BackendTransport`] executes chunks whose source and destination live in one backend
//! address space (the same GPU, a decode pool of another process mapped into this one, or the
//! CPU reference's arena), with one of four [`Method`]s (BENCHMARKS.md compares them):
//! - [`Method::Kernel`] (the default, its grid picked per launch by [`Method::for_blocks`]):
//!   one block-copy launch per page list from page lists
//!   (the chunk's latent KV; the final chunk adds the indexer state, in the same launch when it
//!   covers the same pages, [`block_copies`]); owned pages of a rank sit N apart on the decode
//!   side, so runs rarely coalesce. Page lists are 16 bytes a page and the pair table 24 bytes
//!   a layer pair: up to `abi::KVS_COPY_INLINE_BYTES` (a 64-page final chunk of 62 + 62
//!   layers: 4 KB) they travel in the launch's parameters (`kvs_copy_blocks_inline`), so a
//!   chunk is the launch and its event, with no upload in the stream; larger tables are
//!   uploaded first ([`TableStore::launch`]);
//! - [`Method::RangeKernel`]: one `kvs_copy_ranges` launch over the absolute ranges of a
//!   [`DescriptorBatch`], ranges longer than [`KERNEL_PIECE_BYTES`] split first;
//! - [`Method::CopyEngine`]: one `memcpy_batch` call over the same ranges
//!   (`cuMemcpyBatchAsync`, over NVLink for a peer-mapped pool), which leaves the SMs to the
//!   forward pass;
//! - [`Method::PerBlock`]: the naive baseline, one copy per (page, layer) block, as a transfer
//!   engine posting one descriptor per block does (on a GPU `cuMemcpyAsync` of the peer-mapped
//!   address, what `cudaMemcpyPeerAsync` does once the memory is mapped here).
//!
//! Any other method is refused with [`Error::UnsupportedMethod`] when the transport is made.
//! A [`DescriptorBatch`] is also exactly what a network transfer engine moves (NIXL and
//! Mooncake register memory regions, then take lists of address/length pairs).

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::plan::{DecodePlan, SendPlan};
use super::stats::{Posted, TransferStats};
use super::transport::{Completion, Transport};
use super::ComponentBytes;
use crate::abi;
use crate::backend::{check_space, Backend, Event, Launch};
use crate::copy::space::sealed::Sealed as _;
use crate::copy::{
    BlockCopyPlan, BlockSpace, Method, OwnedRuns, PageSelection, RemoteSpace, TableStore,
};
use crate::error::{Error, Result};
use crate::geometry::Component;
use crate::index::StoredLayer;
use crate::lock::lock;
use crate::pool::DevicePool;

/// Longest range one warp of `kvs_copy_ranges` copies: 64 iterations of the warp's 4 KB
/// (32 lanes x 8 loads of 16 bytes in flight). Short enough that a batch of coalesced runs
/// spreads over the whole grid, long enough that the per-range overhead stays negligible.
pub const KERNEL_PIECE_BYTES: u64 = 256 << 10;

/// `ranges` cut into consecutive pieces of at most [`KERNEL_PIECE_BYTES`], in order: the
/// table [`Method::RangeKernel`] launches over. Empty ranges yield no piece; addresses wrap
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

/// The block copies of one plan: the local source pages into the destination pages of the
/// sections' components, one copy per distinct page list. Consecutive non-empty sections that
/// move the same pages (a request sent as one final chunk: its latent KV and its indexer state)
/// share one copy, so [`Method::Kernel`] launches and uploads once for them; sections over other
/// pages (a later chunk's KV beside the whole sequence's state) get a copy each. What
/// [`Method::Kernel`] launches, and what a bounce-buffered transport packs.
pub fn block_copies(
    plan: &SendPlan,
    src: &dyn BlockSpace,
    dst: &dyn BlockSpace,
) -> Result<Vec<BlockCopyPlan>> {
    plan.check_spaces(src, dst)?;
    // (owned pages, components moved over them), in send order.
    let mut groups: Vec<(&OwnedRuns, Vec<Component>)> = Vec::new();
    for section in plan.sections().into_iter().filter(|s| !s.is_empty()) {
        let owned = section.owned();
        let components = section.components().iter().map(|c| c.component);
        match groups.last_mut() {
            Some((pages, moved))
                if pages.src_pages() == owned.src_pages()
                    && pages.dst_pages() == owned.dst_pages() =>
            {
                moved.extend(components);
            }
            _ => groups.push((owned, components.collect())),
        }
    }
    groups
        .into_iter()
        .map(|(owned, components)| {
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

/// A completion of in-process work: an event of the backend's stream (timed, with a timed
/// event recorded before the work, when the transport times chunks on the device), and what
/// must stay alive until the stream passes it.
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

/// What a [`BackendTransport`] has submitted, summed over chunks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallCounts {
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

impl std::ops::AddAssign for CallCounts {
    fn add_assign(&mut self, other: Self) {
        self.chunks += other.chunks;
        self.launches += other.launches;
        self.copy_calls += other.copy_calls;
        self.descriptors += other.descriptors;
        self.bytes += other.bytes;
    }
}

/// The methods a [`BackendTransport`] runs.
const ACCEPTS: &str = "Kernel, RangeKernel, CopyEngine or PerBlock";

/// Executes chunks on a backend whose address space holds both the source and the
/// destination, in the backend's stream order: the same GPU, the CPU reference's arena, or a
/// decode pool of another process mapped into this one ([`BackendTransport::peer`]).
pub struct BackendTransport {
    store: TableStore,
    method: Method,
    /// Whether each block-copy launch takes its grid from its blocks ([`Method::for_blocks`])
    /// and each decode scatter kvshard's ([`Method::for_decode_scatter`]): what
    /// [`BackendTransport::new`] makes.
    auto_grid: bool,
    /// [`BackendTransport::set_device_timing`].
    timing: bool,
    calls: Arc<Mutex<CallCounts>>,
    stats: TransferStats,
}

impl fmt::Debug for BackendTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendTransport")
            .field("backend", &self.store.backend().name())
            .field("method", &self.method)
            .field("auto_grid", &self.auto_grid)
            .finish_non_exhaustive()
    }
}

impl BackendTransport {
    /// A transport enqueuing on `backend` with the method kvshard picks: the block kernel, each
    /// launch's grid picked from the blocks it moves ([`Method::for_blocks`]; [`method`](Self::method)
    /// says [`Method::default_for`]), a decode scatter's from [`Method::for_decode_scatter`], chunks untimed on the device
    /// ([`BackendTransport::set_device_timing`]).
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        let method = Method::default_for(backend.as_ref());
        let mut transport = Self::named(backend, method, "backend");
        transport.auto_grid = true;
        transport
    }

    /// A transport enqueuing on `backend` with `method`: [`Method::Kernel`],
    /// [`Method::RangeKernel`], [`Method::CopyEngine`] or [`Method::PerBlock`]; any other is
    /// [`Error::UnsupportedMethod`].
    pub fn with_method(backend: Arc<dyn Backend>, method: Method) -> Result<Self> {
        check_method(method)?;
        Ok(Self::named(backend, method, "backend"))
    }

    /// [`BackendTransport::with_method`] for sending into a decode pool of another process
    /// mapped into this one ([`ImportedPool`](crate::ipc::ImportedPool)): both spaces are in
    /// the one backend address space, so a chunk is a launch (or copy-engine calls) of this
    /// process's GPU, with no staging and no network engine. Its [`Transport::stats`] are
    /// labelled `peer`.
    pub fn peer(backend: Arc<dyn Backend>, method: Method) -> Result<Self> {
        check_method(method)?;
        Ok(Self::named(backend, method, "peer"))
    }

    fn named(backend: Arc<dyn Backend>, method: Method, name: &'static str) -> Self {
        let mut transport = Self {
            store: TableStore::new(backend),
            method,
            auto_grid: false,
            timing: true,
            calls: Arc::default(),
            stats: TransferStats::new(name),
        };
        // Chunks untimed by default (`set_device_timing` keeps the store's launches in step).
        transport.set_device_timing(false);
        transport
    }

    /// How this transport moves bytes (for [`BackendTransport::new`]'s, whose launches take
    /// their grids from [`Method::for_blocks`]: [`Method::default_for`]).
    pub fn method(&self) -> Method {
        self.method
    }

    /// Whether each chunk is timed on the device: a timed event before the chunk's first
    /// enqueue and its end event timed, so [`TransferStats`] reports the chunk's device time.
    /// Off (the default), a chunk records only its untimed end event and the stats take the
    /// transfer time from the host's clock when the completion is seen. The two timestamps
    /// between two chunks' launches cost the stream: on the H200, P/D at N = 8 ranks of 64
    /// pages each lost 2.5% of the device-to-device rate to them, 8-page chunks 10%
    /// (BENCHMARKS.md; run of 2026-12-02 at 01e02be). Ordering, lifetimes and completion are the same either way.
    pub fn set_device_timing(&mut self, on: bool) {
        self.timing = on;
        self.store.set_timed(on);
    }

    /// Counters of the calls it submitted, shared: they keep counting after the transport is
    /// handed to a [`Sender`](super::Sender).
    pub fn calls(&self) -> Arc<Mutex<CallCounts>> {
        self.calls.clone()
    }
}

/// Refuses a method no executor of [`BackendTransport`] runs.
fn check_method(method: Method) -> Result<()> {
    match method {
        Method::Kernel(_) | Method::RangeKernel(_) | Method::CopyEngine | Method::PerBlock => {
            Ok(())
        }
        Method::BatchedCopyEngine => Err(unsupported(method)),
    }
}

fn unsupported(method: Method) -> Error {
    Error::UnsupportedMethod {
        method: method.to_string(),
        route: "a P/D transport",
        accepts: ACCEPTS,
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
        let mut counted = CallCounts {
            chunks: 1,
            bytes: plan.bytes().total(),
            ..CallCounts::default()
        };
        let result = self.enqueue(plan, src, dst, &mut counted);
        if result.is_ok() {
            *lock(&self.calls) += counted;
        }
        let method = self.method;
        self.stats.submitted(started, result, || {
            // The per-block baseline posts its copies; the others what a descriptor-based
            // engine would have posted for the plan.
            let descriptors = match method {
                Method::PerBlock => counted.descriptors,
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

    fn submit_decode(
        &mut self,
        plan: &DecodePlan,
        src: &Arc<DevicePool>,
        dsts: &[Arc<RemoteSpace>],
    ) -> Result<Box<dyn Completion>> {
        let started = Instant::now();
        let mut counted = CallCounts {
            chunks: 1,
            bytes: plan.bytes().total(),
            ..CallCounts::default()
        };
        let result = self.enqueue_decode(plan, src, dsts, &mut counted);
        if result.is_ok() {
            *lock(&self.calls) += counted;
        }
        self.stats.submitted(started, result, || {
            // What a transport posting one descriptor per (chunk, prefill rank, decode rank)
            // would have posted.
            Some(Posted {
                bytes: counted.bytes,
                descriptors: plan.decode_ranks_reached() as u64,
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
    /// Enqueues `plan` into a decode context-parallel layout (docs/dcp.md): one
    /// `kvs_decode_scatter` launch writes every decode rank's rows ([`Method::Kernel`] only;
    /// with the automatic grid [`Method::for_decode_scatter`]'s), counting it
    /// into `counted`; what [`Transport::submit_decode`] times and counts.
    fn enqueue_decode(
        &mut self,
        plan: &DecodePlan,
        src: &Arc<DevicePool>,
        dsts: &[Arc<RemoteSpace>],
        counted: &mut CallCounts,
    ) -> Result<Box<dyn Completion>> {
        let Method::Kernel(launch) = self.method else {
            return Err(Error::UnsupportedMethod {
                method: self.method.to_string(),
                route: "a P/D transport into a decode context-parallel layout",
                accepts: "Kernel",
            });
        };
        let backend = self.store.backend().clone();
        let src_space: Arc<dyn BlockSpace> = src.clone();
        let dst_spaces: Vec<Arc<dyn BlockSpace>> = dsts
            .iter()
            .map(|d| d.clone() as Arc<dyn BlockSpace>)
            .collect();
        let refs: Vec<&dyn BlockSpace> = dst_spaces.iter().map(|d| d.as_ref()).collect();
        let scatter = plan.scatter(src_space.as_ref(), &refs)?;
        if scatter.is_empty() {
            return Ok(Box::new(StreamCompletion {
                backend,
                started: None,
                event: None,
                _keep: Vec::new(),
            }));
        }
        let started = self.start(backend.as_ref())?;
        let launch = self.grid(Method::for_decode_scatter(backend.as_ref()), launch);
        let end = self
            .store
            .launch_scatter(&scatter, &src_space, &dst_spaces, launch)?;
        counted.launches += u64::from(end.is_some());
        let end = match end {
            Some(end) => end,
            None if self.timing => backend.record_timed()?,
            None => backend.record()?,
        };
        let mut keep = vec![src_space];
        keep.extend(dst_spaces);
        Ok(Box::new(StreamCompletion {
            started,
            event: Some(end),
            backend,
            _keep: keep,
        }))
    }
}

impl BackendTransport {
    /// The grid of a launch: `launch`, or with [`BackendTransport::new`]'s automatic grid the
    /// one `automatic` names ([`Method::for_blocks`] for a block copy's blocks,
    /// [`Method::for_decode_scatter`] for a decode scatter).
    fn grid(&self, automatic: Method, launch: Launch) -> Launch {
        if !self.auto_grid {
            return launch;
        }
        automatic.launch().unwrap_or(launch)
    }

    /// The chunk's timed start event, when chunks are timed.
    fn start(&self, backend: &dyn Backend) -> Result<Option<Event>> {
        self.timing.then(|| backend.record_timed()).transpose()
    }

    /// Enqueues `plan`'s copies, counting them into `counted`; what [`Transport::submit`] times
    /// and counts.
    fn enqueue(
        &mut self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
        counted: &mut CallCounts,
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
        // Each method plans first and records the timed start just before its first enqueue
        // (a plan refused records nothing); a launch's own event is the chunk's end (the
        // store records one per launch for the usages and its keep-alive, timed), so a kernel
        // chunk costs two event records.
        let (started, end) = match self.method {
            Method::Kernel(launch) => {
                let copies = block_copies(plan, src_space.as_ref(), dst_space.as_ref())?;
                let started = self.start(backend.as_ref())?;
                let mut end = None;
                for copy in &copies {
                    let launch =
                        self.grid(Method::for_blocks(backend.as_ref(), copy.blocks()), launch);
                    end = self
                        .store
                        .launch(copy, &src_space, &dst_space, launch)?
                        .or(end);
                    counted.launches += 1;
                }
                (started, end)
            }
            Method::RangeKernel(launch) => {
                let batch = DescriptorBatch::resolve(plan, src_space.as_ref(), dst_space.as_ref())?;
                let pieces: Vec<_> = kernel_pieces(batch.ranges()).collect();
                let started = self.start(backend.as_ref())?;
                let end = self
                    .store
                    .launch_ranges(&pieces, [&src_space, &dst_space], launch)?;
                counted.launches += 1;
                (started, end)
            }
            Method::CopyEngine => {
                let batch = DescriptorBatch::resolve(plan, src_space.as_ref(), dst_space.as_ref())?;
                for space in [&src_space, &dst_space] {
                    crate::backend::check_space(
                        backend.address_space(),
                        space.address_space(),
                        "a transfer space",
                    )?;
                }
                let started = self.start(backend.as_ref())?;
                let (from, to) = (src_space.usage(), dst_space.usage());
                let ((), end) = crate::backend::ordered_event(
                    backend.as_ref(),
                    &[from],
                    &[to],
                    self.timing,
                    || {
                        // SAFETY: every range lies inside a (component, layer) buffer of the two
                        // spaces (DescriptorBatch::resolve checked every run against their pages,
                        // layers and blocks), which are in the backend's address space (checked
                        // above) and kept alive by their usages and the completion until the stream
                        // has passed the copies.
                        unsafe { backend.memcpy_batch(batch.ranges()) }
                    },
                )?;
                // One range of the batch per descriptor of the plan.
                counted.descriptors = batch.ranges().len() as u64;
                counted.copy_calls = u64::from(counted.descriptors > 0);
                (started, Some(end))
            }
            Method::PerBlock => {
                let started = self.start(backend.as_ref())?;
                let copies = per_block(backend.as_ref(), plan, src, dst)?;
                counted.copy_calls = copies;
                counted.descriptors = copies;
                (started, None)
            }
            // Refused by the constructors; refused here too rather than trusted.
            Method::BatchedCopyEngine => return Err(unsupported(self.method)),
        };
        let end = match end {
            Some(end) => end,
            None if self.timing => backend.record_timed()?,
            None => backend.record()?,
        };
        Ok(Box::new(StreamCompletion {
            started,
            event: Some(end),
            backend,
            _keep: vec![src_space, dst_space],
        }))
    }
}

/// [`Method::PerBlock`]: one copy per (page, layer) block of every non-empty section; returns
/// the copies.
fn per_block(
    backend: &dyn Backend,
    plan: &SendPlan,
    src: &Arc<DevicePool>,
    dst: &Arc<RemoteSpace>,
) -> Result<u64> {
    plan.check_spaces(src.as_ref(), dst.as_ref())?;
    let space = backend.address_space();
    check_space(space, src.address_space(), "the source pool")?;
    check_space(space, dst.address_space(), "the destination")?;
    let mut copies = 0;
    let (reads, writes) = ([src.usage()], [dst.usage()]);
    crate::backend::ordered(backend, &reads, &writes, || {
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
                        // SAFETY: both blocks were checked inside their spaces (block_addr),
                        // which are in this backend's address space (checked above) and kept
                        // alive by their usages and the completion until the stream has passed
                        // the copy.
                        unsafe { backend.memcpy(to, from, c.item as usize)? };
                        copies += 1;
                    }
                }
            }
        }
        Ok(())
    })?;
    Ok(copies)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::copy::WIDE_GRID_BLOCKS;

    #[test]
    fn new_picks_each_launchs_grid_and_a_given_method_keeps_its_grid() {
        let b: Arc<dyn Backend> = Arc::new(CpuBackend::new());
        let given = Launch {
            ctas: 3,
            threads: 64,
        };
        let auto = BackendTransport::new(b.clone());
        let fixed = BackendTransport::with_method(b.clone(), Method::Kernel(given)).unwrap();
        let decode = Method::for_decode_scatter(b.as_ref());
        let picks = [1, 992, WIDE_GRID_BLOCKS, WIDE_GRID_BLOCKS + 1, 7936, 63488].map(|blocks| {
            (
                format!("{blocks} blocks"),
                Method::for_blocks(b.as_ref(), blocks),
            )
        });
        for (what, picked) in picks
            .into_iter()
            .chain([("a decode scatter".into(), decode)])
        {
            assert_eq!(Method::Kernel(auto.grid(picked, given)), picked, "{what}");
            assert_eq!(fixed.grid(picked, given), given, "{what}");
        }
        assert_ne!(
            auto.grid(Method::for_blocks(b.as_ref(), WIDE_GRID_BLOCKS), given),
            auto.grid(Method::for_blocks(b.as_ref(), WIDE_GRID_BLOCKS + 1), given),
            "the rule has two grids"
        );
    }
}
