//! `kvshard pd`: P/D across processes, the multi-process counterpart of `kvshard demo`.
//!
//! [`run`] starts a decode process and N prefill processes (the running executable again, with
//! a hidden role flag), on the CPU twin or one GPU each (round-robin over the GPUs, or as
//! `--gpus` says: the decode's first, then each rank's). The decode allocates its pool as
//! exportable memory and publishes it ([`DecodeEndpoint`]); each prefill rank fills its own pool
//! with random blocks, maps the decode pool and sends every request the decode registers
//! ([`PrefillEndpoint`]), with the method of the request's case. Every case (request size x
//! method) runs `iterations` times; the first is verified block by block against what the
//! ranks hold, every one is timed, on the decode (registration to completion) and on each rank
//! (its stream, first chunk to last). The report is one table: GB/s, the share of the copy
//! ceiling measured in the same run (the peer copy engine across two GPUs, a local copy on one
//! GPU or the CPU), and what each chunk needed (launches, copy-engine calls, descriptors).
//!
//! Nothing waits forever: the decode gives every request [`PdConfig::deadline`] from its
//! registration (`--deadline-ms`), and a request still missing a rank's last status then fails
//! the run with [`Error::TransferDeadline`], naming the request, the ranks and the chunks that
//! arrived.
//!
//! Every process derives the same cases, chains and data from the same [`PdConfig`]: nothing
//! but the protocol's messages travels between them.

pub mod pressure;

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rand::{RngCore, SeedableRng};

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::backend::{Backend, Launch, MemoryKind};
use crate::chain::RequestChain;
use crate::copy::BlockSpace;
use crate::error::{Error, Result};
use crate::geometry::{CacheGeometry, PAGE_SIZE};
use crate::gpu::memory::DeviceAllocation;
use crate::gpu::Gpu;
use crate::index::LocalPage;
use crate::ipc::{ExportedPool, Liveness, PeerBackend};
use crate::pool::DevicePool;
use crate::shard::{Placement, ShardAllocator};
use crate::synth::POISON;
use crate::transfer::{
    ChunkEnd, DecodeEndpoint, DecodeEvent, Finished, PeerMethod, PoolLayout, PrefillEndpoint,
    PrefillEvent, Registration, DEFAULT_DEADLINE,
};

/// Bytes of the random source every block is a window of.
const PATTERN_SPAN: usize = 8 << 20;
/// Tokens the last page of a request leaves empty: a request ends inside a page, as real ones
/// do (the partial page is sent whole with the final chunk).
const TAIL_TOKENS: usize = 16;
/// How long processes wait for each other to start and connect.
pub(crate) const STARTUP: Duration = Duration::from_secs(120);
/// How long a rank waits for the decodes to end a run after its last request, and what bounds
/// a run's processes with [`STARTUP`].
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
/// Prefix of the machine-readable lines the role processes print for [`run`].
pub(crate) const TAG: &str = "@pd";

/// One run of `kvshard pd`, identical in every process of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdConfig {
    /// Run on the CPU twin (memfd pools) instead of GPUs.
    pub cpu: bool,
    /// Prefill processes (the CP group's N).
    pub ranks: u32,
    /// Target layers (every fourth shares its indexer).
    pub layers: usize,
    /// Whether the single-layer MTP draft is present.
    pub draft: bool,
    /// Request sizes in pages, one case each per method.
    pub pages: Vec<usize>,
    /// Pages per prefill chunk.
    pub chunk_pages: usize,
    /// The methods each size is sent with.
    pub methods: Vec<PeerMethod>,
    /// Requests per case (the first is verified).
    pub iterations: usize,
    /// GPUs: the decode's, then each rank's; empty: round-robin (the decode on the last GPU,
    /// rank r on GPU r).
    pub gpus: Vec<usize>,
    /// Seed of the random blocks.
    pub seed: u64,
    /// Pause between a rank's chunks (tests use it to land a kill mid-request).
    pub pace: Duration,
    /// How long the decode waits for a request, from its registration to every rank's last
    /// status, before the run fails with [`Error::TransferDeadline`].
    pub deadline: Duration,
}

/// One case: a request size and the method it is sent with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Case {
    /// Pages of the request.
    pub pages: usize,
    /// How ranks send it.
    pub method: PeerMethod,
}

/// Where a process of a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The decode process.
    Decode,
    /// Prefill rank `r`.
    Prefill(u32),
}

impl PdConfig {
    /// The default for the CPU twin (small, seconds) or GPUs (the production shape).
    pub fn default_for(cpu: bool) -> Self {
        let blocks = |ctas| {
            PeerMethod::Blocks(Launch {
                ctas,
                threads: crate::abi::KVS_COPY_THREADS.min(512),
            })
        };
        if cpu {
            Self {
                cpu,
                ranks: 2,
                layers: 4,
                draft: true,
                pages: vec![9, 40],
                chunk_pages: 4,
                methods: vec![blocks(2), PeerMethod::CopyEngine, PeerMethod::PerBlock],
                iterations: 1,
                gpus: Vec::new(),
                seed: 7,
                pace: Duration::ZERO,
                deadline: DEFAULT_DEADLINE,
            }
        } else {
            Self {
                cpu,
                ranks: 2,
                layers: 61,
                draft: true,
                pages: vec![64, 512, 4096],
                chunk_pages: 64,
                methods: vec![blocks(32), PeerMethod::CopyEngine, PeerMethod::PerBlock],
                iterations: 3,
                gpus: Vec::new(),
                seed: 7,
                pace: Duration::ZERO,
                deadline: DEFAULT_DEADLINE,
            }
        }
    }

    /// The cache every process holds: FP8 "trtllm" latent rows, every fourth target layer
    /// sharing its indexer.
    pub fn geometry(&self) -> CacheGeometry {
        crate::demo::demo_geometry(self.layers, self.draft)
    }

    /// Checks the run makes sense before any process starts.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidArgument(format!("pd: {why}")));
        if self.ranks == 0 || self.ranks > crate::transfer::MAX_PREFILL_RANKS {
            return bad(format!("{} prefill ranks", self.ranks));
        }
        if self.pages.is_empty() || self.pages.contains(&0) {
            return bad(format!(
                "request sizes {:?} (each at least one page)",
                self.pages
            ));
        }
        if self.methods.is_empty() || self.iterations == 0 || self.chunk_pages == 0 {
            return bad("no method, no iteration or empty chunks".into());
        }
        if !self.cpu && !self.gpus.is_empty() && self.gpus.len() != self.ranks as usize + 1 {
            return bad(format!(
                "--gpus names {} GPUs; the decode and {} ranks need {}",
                self.gpus.len(),
                self.ranks,
                self.ranks + 1
            ));
        }
        self.geometry().validate()
    }

    /// Every case, sizes outer, methods inner.
    pub fn cases(&self) -> Vec<Case> {
        self.pages
            .iter()
            .flat_map(|&pages| {
                self.methods
                    .iter()
                    .map(move |&method| Case { pages, method })
            })
            .collect()
    }

    /// The request id of iteration `iteration` of case `case`.
    pub fn request_id(&self, case: usize, iteration: usize) -> u64 {
        (case * self.iterations + iteration) as u64 + 1
    }

    /// The case and iteration of request `request`.
    pub fn case_of(&self, request: u64) -> Option<(usize, usize, Case)> {
        let k = usize::try_from(request.checked_sub(1)?).ok()?;
        let (case, iteration) = (k / self.iterations, k % self.iterations);
        self.cases().get(case).map(|&c| (case, iteration, c))
    }

    /// Tokens of a request of `pages` pages.
    pub fn tokens(pages: usize) -> usize {
        (pages * PAGE_SIZE).saturating_sub(TAIL_TOKENS).max(1)
    }

    /// Where each chunk of a request of `tokens` tokens ends.
    pub fn chunk_ends(&self, tokens: usize) -> Vec<ChunkEnd> {
        let step = self.chunk_pages * PAGE_SIZE;
        let mut ends: Vec<ChunkEnd> = (1..)
            .map(|k| k * step)
            .take_while(|&end| end < tokens)
            .map(ChunkEnd::Partial)
            .collect();
        ends.push(ChunkEnd::Final(tokens));
        ends
    }

    fn max_pages(&self) -> usize {
        self.pages.iter().copied().max().unwrap_or(1)
    }

    /// Pages of each prefill rank's pool.
    pub fn prefill_pages(&self) -> u64 {
        (self.max_pages().div_ceil(self.ranks as usize) + 2) as u64
    }

    /// Pages of the decode pool.
    pub fn decode_pages(&self) -> u64 {
        (self.max_pages() + 2) as u64
    }

    /// The prefill group's chain of a request of `pages` pages: every rank (and the decode's
    /// check) runs the rotated allocator identically from an empty pool.
    pub fn prefill_chain(&self, pages: usize) -> Result<RequestChain> {
        let placement = Placement::new(self.ranks)?;
        let mut allocator = ShardAllocator::new(placement, self.prefill_pages())?;
        let mut chain = RequestChain::new(placement);
        chain.grow_to(&mut allocator, Self::tokens(pages))?;
        Ok(chain)
    }

    /// The GPU of `role`.
    pub fn gpu_of(&self, role: Role, gpus_present: usize) -> usize {
        let at = match role {
            Role::Decode => 0,
            Role::Prefill(r) => r as usize + 1,
        };
        if let Some(&g) = self.gpus.get(at) {
            return g;
        }
        let n = gpus_present.max(1);
        match role {
            Role::Decode => n - 1,
            Role::Prefill(r) => r as usize % n,
        }
    }

    /// The command-line flags that give this configuration.
    pub fn to_args(&self) -> Vec<String> {
        let list = |v: &[usize]| {
            v.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        let mut args = vec![
            "--ranks".to_string(),
            self.ranks.to_string(),
            "--layers".into(),
            self.layers.to_string(),
            "--pages".into(),
            list(&self.pages),
            "--chunk-pages".into(),
            self.chunk_pages.to_string(),
            "--methods".into(),
            self.methods
                .iter()
                .map(method_name)
                .collect::<Vec<_>>()
                .join(","),
            "--iterations".into(),
            self.iterations.to_string(),
            "--seed".into(),
            self.seed.to_string(),
            "--pace-ms".into(),
            self.pace.as_millis().to_string(),
            "--deadline-ms".into(),
            self.deadline.as_millis().to_string(),
        ];
        if self.cpu {
            args.push("--cpu".into());
        }
        if !self.draft {
            args.push("--no-draft".into());
        }
        if !self.gpus.is_empty() {
            args.push("--gpus".into());
            args.push(list(&self.gpus));
        }
        args
    }
}

/// A method as the command line names it: `blocks:CTAS:THREADS`, `ce`, `naive`.
pub fn method_name(method: &PeerMethod) -> String {
    match method {
        PeerMethod::Blocks(l) => format!("blocks:{}:{}", l.ctas, l.threads),
        PeerMethod::CopyEngine => "ce".into(),
        PeerMethod::PerBlock => "naive".into(),
    }
}

/// Parses [`method_name`]'s form (`blocks:CTAS` takes 512 threads).
pub fn parse_method(s: &str) -> Result<PeerMethod> {
    let bad = || {
        Error::InvalidArgument(format!(
            "method {s:?}: expected blocks:CTAS[:THREADS], ce or naive"
        ))
    };
    let mut parts = s.split(':');
    match parts.next() {
        Some("ce") if parts.next().is_none() => Ok(PeerMethod::CopyEngine),
        Some("naive") if parts.next().is_none() => Ok(PeerMethod::PerBlock),
        Some("blocks") => {
            let ctas = parts.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
            let threads = match parts.next() {
                Some(t) => t.parse().map_err(|_| bad())?,
                None => 512,
            };
            if parts.next().is_some() {
                return Err(bad());
            }
            Ok(PeerMethod::Blocks(Launch { ctas, threads }))
        }
        _ => Err(bad()),
    }
}

/// The random source every block of every rank is a window of: block (rank, component, layer,
/// page) starts at an offset hashed from the four, so a block in the wrong place (another page,
/// layer, component or rank) shows as different bytes.
#[derive(Debug, Clone)]
pub struct Pattern {
    bytes: Vec<u8>,
    seed: u64,
}

impl Pattern {
    /// The source of `seed`, long enough for blocks of up to `max_block` bytes.
    pub fn new(seed: u64, max_block: usize) -> Self {
        let mut bytes = vec![0u8; PATTERN_SPAN + max_block];
        rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut bytes);
        Self { bytes, seed }
    }

    /// The bytes of block (`rank`, component index `component`, `layer`, local `page`).
    pub fn block(&self, rank: u32, component: usize, layer: usize, page: u64, len: usize) -> &[u8] {
        let key = crate::synth::mix(
            self.seed
                ^ crate::synth::mix(
                    u64::from(rank) << 48 ^ (component as u64) << 40 ^ (layer as u64) << 32,
                )
                ^ page,
        );
        let span = (self.bytes.len() - len.min(self.bytes.len())) as u64 + 1;
        let at = (key % span) as usize;
        &self.bytes[at..at + len.min(self.bytes.len())]
    }
}

/// The pattern of a run's geometry.
pub fn pattern(cfg: &PdConfig) -> Pattern {
    let max_block = cfg
        .geometry()
        .components()
        .iter()
        .map(|c| c.block_bytes)
        .max()
        .unwrap_or(0);
    Pattern::new(cfg.seed, max_block)
}

/// The bytes of one stored layer of component index `c` of `pool` (an allocated pool: layers
/// are slices of its storage).
pub(crate) fn layer_range(pool: &DevicePool, c: usize, layer: usize) -> Result<(usize, usize)> {
    let comp = &pool.components()[c];
    let storage = pool
        .storage()
        .ok_or_else(|| Error::InvalidArgument("pd pools are allocated by kvshard".into()))?;
    let base = pool.layer_bases(comp.component)?[layer];
    let offset =
        usize::try_from(base - storage.addr()).map_err(|_| Error::overflow("a layer offset"))?;
    Ok((offset, pool.pages() as usize * comp.block_bytes))
}

/// Fills every block of `pool` (rank `rank`'s) with its pattern window, one write per layer
/// (each blocks the host until written).
pub fn fill_pool_sync(backend: &dyn Backend, pool: &DevicePool, pattern: &Pattern) -> Result<()> {
    let storage = pool
        .storage()
        .ok_or_else(|| Error::InvalidArgument("pd pools are allocated by kvshard".into()))?;
    for (c, comp) in pool.components().iter().enumerate() {
        for layer in 0..comp.layers() {
            let (offset, len) = layer_range(pool, c, layer)?;
            let mut data = Vec::with_capacity(len);
            for page in 0..pool.pages() {
                data.extend_from_slice(pattern.block(
                    pool.rank(),
                    c,
                    layer,
                    page,
                    comp.block_bytes,
                ));
            }
            backend.write_sync(storage, offset, &data)?;
        }
    }
    Ok(())
}

/// Checks the decode pool after `registration` was sent from `chain`: every registered block
/// holds its source rank's pattern window, and every other block from the page before the
/// lowest registered page to the page after the highest the poison (reading back only that
/// window keeps large pools quick to check). Blocks the host until `backend` has caught up.
pub fn verify_sync(
    backend: &dyn Backend,
    pool: &DevicePool,
    pattern: &Pattern,
    cfg: &PdConfig,
    chain: &RequestChain,
    registration: &Registration,
) -> Result<()> {
    let placement = Placement::new(cfg.ranks)?;
    verify_landed(backend, pool, registration, &mut |c, layer, position| {
        let src = chain
            .pages()?
            .get(position)
            .ok_or_else(|| Error::InvalidArgument(format!("position {position} past the chain")))?;
        let block = pool.components()[c].block_bytes;
        let (rank, local) = (placement.owner(*src), placement.local(*src));
        Ok(pattern.block(rank, c, layer, local.0, block).to_vec())
    })
}

/// Checks the decode pool after `registration` landed: every registered block equals what
/// `expected` says the block of (component index, stored layer, sequence position) is, and
/// every other block from the page before the lowest registered page to the page after the
/// highest holds the poison. Waits for `backend`.
pub(crate) fn verify_landed(
    backend: &dyn Backend,
    pool: &DevicePool,
    registration: &Registration,
    expected: &mut dyn FnMut(usize, usize, usize) -> Result<Vec<u8>>,
) -> Result<()> {
    let storage = pool
        .storage()
        .ok_or_else(|| Error::InvalidArgument("pd pools are allocated by kvshard".into()))?;
    let prefix = registration.prefix_pages;
    let registered = registration.pages.iter().chain(&registration.state_pages);
    let lo = registered
        .clone()
        .map(|p| p.0)
        .min()
        .unwrap_or(0)
        .saturating_sub(1);
    let hi = registered
        .map(|p| p.0 + 2)
        .max()
        .unwrap_or(0)
        .min(pool.pages());
    let window = usize::try_from(lo).map_err(|_| Error::overflow("a page window"))?
        ..usize::try_from(hi.max(lo)).map_err(|_| Error::overflow("a page window"))?;
    for (c, comp) in pool.components().iter().enumerate() {
        // Latent blocks go where the registration put each position after the prefix; the
        // indexer state of every position goes to its state page.
        let targets: Vec<(usize, LocalPage)> = if comp.component.is_indexer() {
            registration
                .state_pages
                .iter()
                .copied()
                .enumerate()
                .collect()
        } else {
            registration
                .pages
                .iter()
                .enumerate()
                .map(|(i, &p)| (prefix + i, p))
                .collect()
        };
        let block = comp.block_bytes;
        for layer in 0..comp.layers() {
            let (offset, _) = layer_range(pool, c, layer)?;
            let len = window.len() * block;
            let got = backend.read_sync(storage, offset + window.start * block, len)?;
            let mut want = vec![POISON; len];
            for &(position, dst) in &targets {
                let at = (dst.0 as usize - window.start) * block;
                let bytes = expected(c, layer, position)?;
                if bytes.len() != block {
                    return Err(Error::Verification(format!(
                        "{} bytes expected of a {block}-byte block",
                        bytes.len()
                    )));
                }
                want[at..at + block].copy_from_slice(&bytes);
            }
            if got != want {
                let page = window.start
                    + got
                        .chunks(block)
                        .zip(want.chunks(block))
                        .position(|(g, w)| g != w)
                        .unwrap_or(0);
                return Err(Error::Transfer {
                    request: registration.request,
                    reason: format!(
                        "decode pool differs at {} stored layer {layer} page {page}",
                        comp.component
                    ),
                });
            }
        }
    }
    Ok(())
}

/// The backend of a role process: the CPU twin, or the GPU `gpu_of` picks from the count.
pub(crate) fn open_backend(cpu: bool, gpu_of: impl FnOnce(usize) -> usize) -> Result<PeerBackend> {
    if cpu {
        return Ok(PeerBackend::Cpu(Arc::new(CpuBackend::new())));
    }
    let gpu = Gpu::open(gpu_of(gpu_count()?))?;
    Ok(PeerBackend::Cuda(Arc::new(CudaBackend::new(gpu)?)))
}

pub(crate) fn gpu_count() -> Result<usize> {
    if !crate::gpu::driver_present() {
        return Err(Error::NoDriver);
    }
    cudarc::driver::result::init().map_err(Error::driver("cuInit"))?;
    let n =
        cudarc::driver::result::device::get_count().map_err(Error::driver("cuDeviceGetCount"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

pub(crate) fn gbps(bytes: u64, ms: f64) -> f64 {
    if ms > 0.0 {
        bytes as f64 / ms / 1e6
    } else {
        0.0
    }
}

/// The best of four runs of the copy `copy` enqueues on `b`, in milliseconds (the first also
/// touches every page).
pub(crate) fn best_of_four(b: &dyn Backend, mut copy: impl FnMut() -> Result<()>) -> Result<f64> {
    (0..4).try_fold(f64::MAX, |best, _| {
        Ok(best.min(crate::demo::timed(b, &mut copy)?))
    })
}

/// The copy ceiling of a run, measured from a decode process: the peer copy engine moving 1 GiB
/// from `source`'s GPU (the first rank's) into the decode's when they differ
/// (`cuMemcpyPeerAsync`), a local device copy of 1 GiB on one GPU, a 32 MiB copy on the CPU
/// twin. Best of four (the first also touches every page).
pub(crate) fn ceiling(
    backend: &PeerBackend,
    source: impl FnOnce(usize) -> usize,
) -> Result<(f64, String)> {
    let (len, what) = match backend {
        PeerBackend::Cpu(_) => (
            32usize << 20,
            "CPU twin copy of 32 MiB (indicative only)".to_string(),
        ),
        PeerBackend::Cuda(_) => (1usize << 30, String::new()),
    };
    let b = backend.backend();
    let dst = b.alloc(len, MemoryKind::Device)?;
    let best;
    let mut what = what;
    match backend {
        PeerBackend::Cpu(_) => {
            let src = b.alloc(len, MemoryKind::Device)?;
            // SAFETY: two live allocations of `len` bytes of this backend, held past the wait.
            best = best_of_four(b.as_ref(), || unsafe {
                b.memcpy(dst.addr(), src.addr(), len)
            })?;
        }
        PeerBackend::Cuda(cuda) => {
            let here = cuda.gpu().info().ordinal;
            let there = source(gpu_count()?);
            let peer = (there != here).then(|| Gpu::open(there)).transpose()?;
            let src = match &peer {
                Some(g) => DeviceAllocation::new(g.context(), len)?,
                None => DeviceAllocation::new(cuda.gpu().context(), len)?,
            };
            what = match &peer {
                Some(_) => format!("peer copy engine GPU {there} -> GPU {here}, 1 GiB"),
                None => format!("local D2D copy on GPU {here}, 1 GiB"),
            };
            best = best_of_four(b.as_ref(), || {
                match &peer {
                    Some(g) => {
                        // The copy is enqueued on the decode's stream, with its context current.
                        cuda.gpu().bind()?;
                        // SAFETY: both allocations hold `len` bytes and outlive the copy (the
                        // end event is waited for below); the contexts are their devices'.
                        unsafe {
                            cudarc::driver::sys::cuMemcpyPeerAsync(
                                dst.addr(),
                                cuda.gpu().context().cu_ctx(),
                                src.ptr(),
                                g.context().cu_ctx(),
                                len,
                                cuda.stream().raw(),
                            )
                        }
                        .result()
                        .map_err(Error::driver("cuMemcpyPeerAsync"))?;
                    }
                    // SAFETY: two live device allocations of `len` bytes on this GPU.
                    None => unsafe { b.memcpy(dst.addr(), src.ptr(), len)? },
                }
                Ok(())
            })?;
        }
    }
    Ok((gbps(len as u64, best), what))
}

/// The decode process: allocates and publishes its pool, registers every request of every
/// case in turn, waits for each, verifies the first of each case and prints what it measured.
pub fn decode_role(cfg: &PdConfig, socket: &Path) -> Result<()> {
    cfg.validate()?;
    let backend = open_backend(cfg.cpu, |n| cfg.gpu_of(Role::Decode, n))?;
    let b = backend.backend();
    let (ceiling_gbps, ceiling_what) = ceiling(&backend, |n| cfg.gpu_of(Role::Prefill(0), n))?;
    println!(
        "{TAG} ceiling gbps={ceiling_gbps:.1} what={}",
        ceiling_what.replace(' ', "_")
    );
    let g = cfg.geometry();
    let exported = Arc::new(ExportedPool::allocate(
        &backend,
        &g,
        Placement::unsharded(),
        0,
        cfg.decode_pages(),
    )?);
    println!(
        "decode: pool of {} pages shared as {:?}{}",
        cfg.decode_pages(),
        exported.memory(),
        exported
            .fabric_absent()
            .map_or(String::new(), |why| format!(" (no fabric handle: {why})"))
    );
    let pool = exported.pool().clone();
    let pattern = pattern(cfg);
    let mut endpoint =
        DecodeEndpoint::bind(socket, backend.clone(), cfg.ranks, Liveness::default())?;
    endpoint.set_deadline(cfg.deadline);
    endpoint.wait_for_ranks_sync(STARTUP)?;
    let pool_id = endpoint.publish(exported)?;
    let mut watch = DecodeWatch::new(endpoint);
    for (case, c) in cfg.cases().into_iter().enumerate() {
        for iteration in 0..cfg.iterations {
            let request = cfg.request_id(case, iteration);
            let verified = iteration == 0;
            if verified {
                pool.fill(b.as_ref(), POISON)?;
                b.synchronize()?;
            }
            let mut allocator = ShardAllocator::new(Placement::unsharded(), pool.pages())?;
            let mut chain = RequestChain::new(Placement::unsharded());
            chain.grow_to(&mut allocator, PdConfig::tokens(c.pages))?;
            let registration = chain.registration(request, PoolLayout::of(&pool), 0)?;
            let start = Instant::now();
            watch.endpoint.register(pool_id, registration)?;
            let (finished, _) = watch.wait_sync(request)?;
            let wall_ms = start.elapsed().as_secs_f64() * 1e3;
            if !finished.is_completed() {
                return Err(Error::Transfer {
                    request,
                    reason: format!("failed: {:?}", finished.outcome),
                });
            }
            if verified {
                let source = cfg.prefill_chain(c.pages)?;
                verify_sync(
                    b.as_ref(),
                    &pool,
                    &pattern,
                    cfg,
                    &source,
                    &finished.registration,
                )?;
            }
            println!(
                "{TAG} case={case} iter={iteration} wall_ms={wall_ms:.4} bytes={} verified={verified}",
                finished.total_bytes().total()
            );
        }
    }
    Ok(())
}

/// A decode's endpoint and the requests it has seen finish, each with when it was seen.
pub(crate) struct DecodeWatch {
    pub(crate) endpoint: DecodeEndpoint,
    finished: HashMap<u64, (Finished, SystemTime)>,
}

impl DecodeWatch {
    pub(crate) fn new(endpoint: DecodeEndpoint) -> Self {
        Self {
            endpoint,
            finished: HashMap::new(),
        }
    }

    /// Takes what the ranks said within `timeout`; a rank going, or a request's deadline
    /// passing ([`Error::TransferDeadline`]), is an error.
    fn poll_sync(&mut self, timeout: Duration) -> Result<()> {
        for event in self.endpoint.poll_sync(timeout)? {
            match event {
                DecodeEvent::Finished(f) => {
                    self.finished.insert(f.request(), (*f, SystemTime::now()));
                }
                DecodeEvent::RankGone { rank, why, .. } => {
                    return Err(Error::PeerGone {
                        rank: Some(rank),
                        why,
                    })
                }
                DecodeEvent::Overdue(overdue) => return Err(overdue.into()),
                DecodeEvent::Refused { why } => println!("decode: refused a connection: {why}"),
                DecodeEvent::Joined { .. } => {}
            }
        }
        Ok(())
    }

    /// Polls until `request`, registered with the endpoint, has finished: within the
    /// endpoint's deadline, or [`Error::TransferDeadline`] says what never arrived.
    pub(crate) fn wait_sync(&mut self, request: u64) -> Result<(Finished, SystemTime)> {
        let start = Instant::now();
        // The endpoint reports a request it tracks overdue at its deadline: one still waited
        // for a poll later was never registered there.
        let limit = self
            .endpoint
            .deadline()
            .saturating_add(Duration::from_secs(1));
        loop {
            if let Some(done) = self.finished.remove(&request) {
                return Ok(done);
            }
            if start.elapsed() > limit {
                return Err(Error::Timeout {
                    what: format!("request {request}, which the decode never registered"),
                    waited: start.elapsed(),
                });
            }
            self.poll_sync(Duration::from_millis(20))?;
        }
    }
}

/// What a prefill rank did before the decode closed the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillSummary {
    /// Requests sent to the end.
    pub served: usize,
    /// Requests that failed or were aborted.
    pub failed: Vec<u64>,
    /// Why the endpoint closed.
    pub closed: String,
    /// Decode pools still mapped after it closed (0: the mappings were dropped).
    pub mapped_after_close: usize,
}

/// A prefill rank: fills its pool, connects, and sends every request the decode registers with
/// its case's method, until the decode closes the connection.
pub fn prefill_role(cfg: &PdConfig, socket: &Path, rank: u32) -> Result<PrefillSummary> {
    cfg.validate()?;
    let backend = open_backend(cfg.cpu, |n| cfg.gpu_of(Role::Prefill(rank), n))?;
    let b = backend.backend();
    let pool = Arc::new(DevicePool::allocate(
        b.as_ref(),
        &cfg.geometry(),
        Placement::new(cfg.ranks)?,
        rank,
        cfg.prefill_pages(),
    )?);
    fill_pool_sync(b.as_ref(), &pool, &pattern(cfg))?;
    let first = cfg
        .methods
        .first()
        .copied()
        .unwrap_or(PeerMethod::CopyEngine);
    let endpoint =
        PrefillEndpoint::connect(socket, backend, pool, first, Liveness::default(), STARTUP)?;
    let mut rank_loop = RankLoop {
        cfg,
        endpoint,
        backend: b,
        queue: VecDeque::new(),
        aborted: HashSet::new(),
        summary: PrefillSummary {
            served: 0,
            failed: Vec::new(),
            closed: String::new(),
            mapped_after_close: 0,
        },
        closed: false,
    };
    while !rank_loop.closed {
        let events = rank_loop.endpoint.poll_sync(Duration::from_millis(50))?;
        rank_loop.take(events);
        while let Some(request) = rank_loop.queue.pop_front() {
            if rank_loop.send_request(request)? {
                rank_loop.summary.served += 1;
            }
        }
    }
    rank_loop.summary.mapped_after_close = rank_loop.endpoint.mapped_pools();
    Ok(rank_loop.summary)
}

/// A prefill rank's loop: the requests it was given and what became of them.
struct RankLoop<'a> {
    cfg: &'a PdConfig,
    endpoint: PrefillEndpoint,
    backend: Arc<dyn Backend>,
    queue: VecDeque<u64>,
    aborted: HashSet<u64>,
    summary: PrefillSummary,
    closed: bool,
}

impl RankLoop<'_> {
    fn take(&mut self, events: Vec<PrefillEvent>) {
        let rank = self.endpoint.rank();
        for event in events {
            match event {
                PrefillEvent::Registered { request } => self.queue.push_back(request),
                PrefillEvent::Aborted { request, .. } => {
                    self.queue.retain(|&r| r != request);
                    self.aborted.insert(request);
                    self.summary.failed.push(request);
                }
                PrefillEvent::RegistrationRefused { request, why } => {
                    println!("rank {rank}: request {request} refused: {why}");
                    self.summary.failed.push(request);
                }
                PrefillEvent::PoolRefused { pool, why } => {
                    println!("rank {rank}: pool {pool} refused: {why}")
                }
                PrefillEvent::PoolImported { .. } => {}
                PrefillEvent::Closed { why, failed } => {
                    self.summary.failed.extend(failed);
                    self.summary.closed = why;
                    self.closed = true;
                }
            }
        }
    }

    /// Sends every chunk of `request` (from the decode's cached prefix on); `false` when it
    /// failed, was aborted or the connection closed on the way (counted where that was seen).
    fn send_request(&mut self, request: u64) -> Result<bool> {
        let rank = self.endpoint.rank();
        let Some((case, iteration, c)) = self.cfg.case_of(request) else {
            self.endpoint.abort(request, "no such case in this run")?;
            self.summary.failed.push(request);
            return Ok(false);
        };
        self.endpoint.set_method(c.method)?;
        let chain = self.cfg.prefill_chain(c.pages)?;
        let prefix = self
            .endpoint
            .registration(request)
            .map_or(0, |r| r.prefix_pages * PAGE_SIZE);
        let ends: Vec<ChunkEnd> = self
            .cfg
            .chunk_ends(PdConfig::tokens(c.pages))
            .into_iter()
            .filter(|e| !matches!(e, ChunkEnd::Partial(t) if *t <= prefix))
            .collect();
        let before = self.endpoint.stats();
        let start = self.backend.record_timed()?;
        for (k, &end) in ends.iter().enumerate() {
            if k > 0 {
                if !self.cfg.pace.is_zero() {
                    std::thread::sleep(self.cfg.pace);
                }
                // An abort (or the decode's end) between chunks stops the request here.
                let events = self.endpoint.poll_sync(Duration::ZERO)?;
                self.take(events);
                if self.closed || self.aborted.contains(&request) {
                    return Ok(false);
                }
            }
            match self.endpoint.send(request, chain.pages()?, end) {
                Ok(_) => {}
                Err(Error::ChunkFailed { reason, .. }) => {
                    println!("rank {rank}: request {request} failed: {reason}");
                    self.summary.failed.push(request);
                    return Ok(false);
                }
                // The decode is gone (its Closed event lists the request) or aborted it (its
                // Aborted event does).
                Err(Error::PeerGone { .. }) | Err(Error::Transfer { .. }) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        let end = self.backend.record_timed()?;
        self.backend.wait_event_sync(&end)?;
        let kernel_ms = self.backend.elapsed_ms(&start, &end)?;
        let s = self.endpoint.stats();
        println!(
            "{TAG} case={case} iter={iteration} rank={rank} kernel_ms={kernel_ms:.4} chunks={} launches={} calls={} descriptors={} rank_bytes={}",
            s.chunks - before.chunks,
            s.launches - before.launches,
            s.copy_calls - before.copy_calls,
            s.descriptors - before.descriptors,
            s.bytes - before.bytes,
        );
        Ok(true)
    }
}

/// A tagged line's `key=value` fields.
pub(crate) fn fields(line: &str) -> HashMap<String, String> {
    line.split_whitespace()
        .filter_map(|f| f.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A child process of the run, killed and reaped if the run ends before it does.
struct RoleProcess {
    name: String,
    child: Child,
}

impl Drop for RoleProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits for every process; the first that fails (or a run past its time) gets the others
/// killed. Returns what failed.
fn wait_all(processes: &mut [(RoleProcess, std::thread::JoinHandle<()>)]) -> Vec<String> {
    let start = Instant::now();
    let limit = STARTUP + REQUEST_TIMEOUT * 4;
    let mut running: Vec<bool> = vec![true; processes.len()];
    let mut failures = Vec::new();
    while running.iter().any(|&r| r) {
        for (i, (p, _)) in processes.iter_mut().enumerate() {
            if !running[i] {
                continue;
            }
            match p.child.try_wait() {
                Ok(Some(status)) => {
                    running[i] = false;
                    if !status.success() {
                        failures.push(format!("{} exited with {status}", p.name));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    running[i] = false;
                    failures.push(format!("{}: {e}", p.name));
                }
            }
        }
        if !failures.is_empty() || start.elapsed() > limit {
            if failures.is_empty() {
                failures.push(format!("still running after {limit:?}"));
            }
            for (p, _) in processes.iter_mut() {
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
            return failures;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    failures
}

/// What [`run`] measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// The table, in markdown.
    pub markdown: String,
}

/// Runs `cfg`: starts the decode and the N prefill processes (`exe pd --role ...`), forwards
/// what they print, and builds the table from their tagged lines.
pub fn run(cfg: &PdConfig, exe: &Path) -> Result<Report> {
    cfg.validate()?;
    let socket = std::env::temp_dir().join(format!("kvshard-pd-{}.sock", std::process::id()));
    let mut args = vec!["pd".to_string()];
    args.extend(cfg.to_args());
    args.push("--socket".into());
    args.push(socket.display().to_string());
    let mut roles = vec![("decode".to_string(), vec!["--role".into(), "decode".into()])];
    for r in 0..cfg.ranks {
        roles.push((
            format!("rank {r}"),
            vec![
                "--role".into(),
                "prefill".into(),
                "--rank".into(),
                r.to_string(),
            ],
        ));
    }
    let lines = run_roles(exe, &args, roles);
    let _ = std::fs::remove_file(&socket);
    Ok(Report {
        markdown: table(cfg, &lines?),
    })
}

/// Starts `exe ARGS ROLE_ARGS` for every (name, role arguments) of `roles`, forwards what they
/// print (prefixed with the name) and returns their tagged lines with the name of the process
/// that printed each, once every process has exited; the first that fails (or a run past its
/// time) gets the others killed and fails the run.
pub(crate) fn run_roles(
    exe: &Path,
    args: &[String],
    roles: Vec<(String, Vec<String>)>,
) -> Result<Vec<(String, String)>> {
    let lines: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let spawn =
        |name: String, role: Vec<String>| -> Result<(RoleProcess, std::thread::JoinHandle<()>)> {
            let mut child = Command::new(exe)
                .args(args)
                .args(role)
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|source| Error::Os {
                    call: "spawn a role process",
                    source,
                })?;
            let stdout = child.stdout.take().ok_or_else(|| Error::Os {
                call: "pipe a role's output",
                source: std::io::Error::other("no stdout"),
            })?;
            let sink = lines.clone();
            let tag = name.clone();
            let reader = std::thread::spawn(move || {
                for line in BufReader::new(stdout)
                    .lines()
                    .map_while(std::io::Result::ok)
                {
                    if line.starts_with(TAG) {
                        sink.lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push((tag.clone(), line));
                    } else {
                        println!("[{tag}] {line}");
                    }
                }
            });
            Ok((RoleProcess { name, child }, reader))
        };
    let mut processes = Vec::with_capacity(roles.len());
    for (name, role) in roles {
        processes.push(spawn(name, role)?);
    }
    let failures = wait_all(&mut processes);
    for (_, reader) in processes {
        let _ = reader.join();
    }
    if !failures.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "pd run failed: {}",
            failures.join("; ")
        )));
    }
    let lines = std::mem::take(&mut *lines.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(lines)
}

pub(crate) fn num(f: &HashMap<String, String>, key: &str) -> f64 {
    f.get(key).and_then(|v| v.parse().ok()).unwrap_or(0.0)
}

/// The report table from the role processes' tagged lines.
fn table(cfg: &PdConfig, lines: &[(String, String)]) -> String {
    let parsed: Vec<HashMap<String, String>> = lines.iter().map(|(_, l)| fields(l)).collect();
    let ceiling = parsed
        .iter()
        .find(|f| f.contains_key("gbps") && f.contains_key("what"));
    let (ceiling_gbps, ceiling_what) = ceiling.map_or((0.0, String::new()), |f| {
        (
            num(f, "gbps"),
            f.get("what").cloned().unwrap_or_default().replace('_', " "),
        )
    });
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} prefill rank(s) -> decode, {} target layers{}, chunks of {} pages, {} iteration(s) per case; ceiling: {ceiling_what}: {ceiling_gbps:.1} GB/s\n",
        cfg.ranks,
        cfg.layers,
        if cfg.draft { " + MTP draft" } else { "" },
        cfg.chunk_pages,
        cfg.iterations
    );
    let _ = writeln!(
        out,
        "| pages | method | GB/s end to end | GB/s on the ranks' streams | % of ceiling (streams) | launches / chunk | copy calls / chunk | descriptors / chunk | verified |"
    );
    let _ = writeln!(out, "|---:|---|---:|---:|---:|---:|---:|---:|---|");
    for (case, c) in cfg.cases().into_iter().enumerate() {
        let of_case = |f: &&HashMap<String, String>| {
            f.get("case").and_then(|v| v.parse::<usize>().ok()) == Some(case)
        };
        let decode: Vec<_> = parsed
            .iter()
            .filter(of_case)
            .filter(|f| f.contains_key("wall_ms"))
            .collect();
        let ranks: Vec<_> = parsed
            .iter()
            .filter(of_case)
            .filter(|f| f.contains_key("kernel_ms"))
            .collect();
        // Best iteration end to end; on the streams, each iteration's slowest rank, best of those.
        let bytes = decode.iter().map(|f| num(f, "bytes")).fold(0.0, f64::max) as u64;
        let wall = decode
            .iter()
            .map(|f| num(f, "wall_ms"))
            .fold(f64::MAX, f64::min);
        let stream = (0..cfg.iterations)
            .map(|i| {
                ranks
                    .iter()
                    .filter(|f| num(f, "iter") as usize == i)
                    .map(|f| num(f, "kernel_ms"))
                    .fold(0.0, f64::max)
            })
            .filter(|&ms| ms > 0.0)
            .fold(f64::MAX, f64::min);
        let per_chunk = |key: &str| {
            let first: Vec<_> = ranks.iter().filter(|f| num(f, "iter") == 0.0).collect();
            let chunks: f64 = first.iter().map(|f| num(f, "chunks")).sum();
            let total: f64 = first.iter().map(|f| num(f, key)).sum();
            if chunks > 0.0 {
                total / chunks
            } else {
                0.0
            }
        };
        let verified = decode
            .iter()
            .any(|f| f.get("verified").map(String::as_str) == Some("true"));
        let stream_gbps = gbps(bytes, stream);
        // The CPU twin's copies say nothing about hardware: no share of a ceiling for them.
        let share = if cfg.cpu || ceiling_gbps <= 0.0 {
            "n/a".to_string()
        } else {
            format!("{:.0}%", 100.0 * stream_gbps / ceiling_gbps)
        };
        let _ = writeln!(
            out,
            "| {} | {} | {:.1} | {:.1} | {} | {:.1} | {:.1} | {:.1} | {} |",
            c.pages,
            c.method,
            gbps(bytes, wall),
            stream_gbps,
            share,
            per_chunk("launches"),
            per_chunk("calls"),
            per_chunk("descriptors"),
            if verified { "byte-identical" } else { "NO" },
        );
    }
    out
}
