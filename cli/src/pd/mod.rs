//! `kvshard pd`: P/D across processes, the multi-process counterpart of `kvshard demo`.
//!
//! [`run`] starts N prefill processes and a decode process (the running executable again, with
//! a hidden role flag), on the CPU twin or on GPUs ([`Processes`]: rank r on GPU r, the decode
//! on the GPU after the ranks or the last one, or as `--gpus` says). The decode allocates its
//! pool as exportable memory and publishes it ([`DecodeEndpoint`]); each prefill rank fills its
//! own pool with random blocks, maps the decode pool and sends every request the decode
//! registers ([`PrefillEndpoint`]), with the method of the request's case. Every case (request
//! size x method) runs `iterations` times; the first is verified block by block against what
//! the ranks hold, every one is timed, on the decode (registration to completion) and on each
//! rank (its stream, first chunk to last). The report is one table: GB/s, the share of the copy
//! ceiling measured in the same run (the peer copy engine across two GPUs, a local copy on one
//! GPU or the CPU), and what each chunk needed (launches, copy-engine calls, descriptors).
//!
//! Nothing waits forever: the decode gives every request [`Processes::deadline`] from its
//! registration (`--deadline-ms`), and a request still missing a rank's last status then fails
//! the run with [`Error::TransferDeadline`], naming the request, the ranks and the chunks that
//! arrived.
//!
//! Every process derives the same cases, chains and data from the same [`PdConfig`]: nothing
//! but the protocol's messages travels between them, and each process tells the parent what it
//! measured in typed [`message::Message`]s.

pub mod message;
pub mod pressure;

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt::{self, Write as _};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{Backend, Launch, MemoryKind};
use kvshard::chain::RequestChain;
use kvshard::copy::{BlockSpace, Method};
use kvshard::geometry::PAGE_SIZE;
use kvshard::gpu::Gpu;
use kvshard::index::LocalPage;
use kvshard::ipc::{ExportedPool, Liveness, PeerBackend};
use kvshard::pool::DevicePool;
use kvshard::shard::{Placement, ShardAllocator};
use kvshard::transfer::{
    ChunkEnd, DecodeEndpoint, DecodeEvent, Finished, PoolLayout, PrefillEndpoint, PrefillEvent,
    Registration, DEFAULT_DEADLINE,
};
use kvshard::{Error, Result};
use rand::{RngCore, SeedableRng};

use crate::measure::{copy_sync, gbps, peer_sync, time_sync, Ceiling, Timer};
use crate::overflow;
use crate::scenario::{Platform, Shape};
use crate::synth::{mix, POISON};
use message::Message;

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
/// Most decode processes a run may have.
pub const MAX_DECODES: u32 = 8;

/// A process of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Prefill rank `r` of the CP group.
    Rank(u32),
    /// Decode `d`.
    Decode(u32),
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Role::Rank(r) => write!(f, "rank {r}"),
            Role::Decode(d) => write!(f, "decode {d}"),
        }
    }
}

/// Where the processes of a run execute and how long a decode waits: what both `pd` scenarios
/// share, identical in every process of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Processes {
    /// The CPU twin (memfd pools) or GPUs.
    pub platform: Platform,
    /// Decode processes (the transfer scenario has one).
    pub decodes: u32,
    /// GPUs: each rank's, then each decode's; empty: rank r on GPU r (modulo the count), the
    /// decodes on the GPUs after the ranks, sharing the last one when there are not enough.
    pub gpus: Vec<usize>,
    /// How long a decode waits for a request, from its registration to every rank's last
    /// status, before the run fails with [`Error::TransferDeadline`].
    pub deadline: Duration,
}

impl Processes {
    /// `decodes` decode processes on `platform`, the default placement and deadline.
    pub fn new(platform: Platform, decodes: u32) -> Self {
        Self {
            platform,
            decodes,
            gpus: Vec::new(),
            deadline: DEFAULT_DEADLINE,
        }
    }

    /// Processes of a run of `ranks` prefill ranks.
    pub fn count(&self, ranks: u32) -> u32 {
        ranks.saturating_add(self.decodes)
    }

    /// Checks the processes of a run of `ranks` ranks make sense: 1 to [`MAX_DECODES`]
    /// decodes, a GPU named for each process or none, a deadline.
    pub fn check(&self, ranks: u32) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidArgument(format!("pd: {why}")));
        if self.decodes == 0 || self.decodes > MAX_DECODES {
            return bad(format!("{} decodes (1 to {MAX_DECODES})", self.decodes));
        }
        if !self.gpus.is_empty() {
            if !self.platform.is_gpu() {
                return bad("--gpus names GPUs: a run on the CPU twin has none".into());
            }
            let count = self.count(ranks) as usize;
            if self.gpus.len() != count {
                return bad(format!(
                    "--gpus names {} GPUs; {ranks} ranks and {} decodes need {count}",
                    self.gpus.len(),
                    self.decodes
                ));
            }
        }
        if self.deadline.is_zero() {
            return bad("a deadline of 0 ms fails every request".into());
        }
        Ok(())
    }

    /// The GPU of `role` in a run of `ranks` ranks on a machine of `present` GPUs.
    pub fn gpu_of(&self, ranks: u32, role: Role, present: usize) -> usize {
        let ranks = ranks as usize;
        let at = match role {
            Role::Rank(r) => r as usize,
            Role::Decode(d) => ranks + d as usize,
        };
        if let Some(&g) = self.gpus.get(at) {
            return g;
        }
        let n = present.max(1);
        match role {
            Role::Rank(r) => r as usize % n,
            Role::Decode(d) if n > ranks => ranks + d as usize % (n - ranks),
            Role::Decode(_) => n - 1,
        }
    }

    /// Whether two or more of the `ranks` ranks share a GPU (and so its SMs and host link) on
    /// this machine: always on the CPU twin, else as the GPUs present place them.
    pub fn ranks_share_a_gpu(&self, ranks: u32) -> bool {
        let present = match self.platform {
            Platform::Cpu => 1,
            _ => gpu_count().unwrap_or(1),
        };
        ranks > 1 && !self.ranks_on_distinct_gpus(ranks, present)
    }

    /// Whether the `ranks` ranks sit on distinct GPUs of a machine of `present` (NCCL's
    /// condition).
    pub fn ranks_on_distinct_gpus(&self, ranks: u32, present: usize) -> bool {
        let mut gpus: Vec<usize> = (0..ranks)
            .map(|r| self.gpu_of(ranks, Role::Rank(r), present))
            .collect();
        gpus.sort_unstable();
        gpus.dedup();
        gpus.len() == ranks as usize
    }

    /// The backend of the process of `role` in a run of `ranks` ranks: the CPU twin, or its GPU.
    pub fn open_backend(&self, ranks: u32, role: Role) -> Result<PeerBackend> {
        if !self.platform.is_gpu() {
            return Ok(PeerBackend::Cpu(Arc::new(CpuBackend::new())));
        }
        let gpu = Gpu::open(self.gpu_of(ranks, role, gpu_count()?))?;
        Ok(PeerBackend::Cuda(Arc::new(CudaBackend::new(gpu)?)))
    }

    /// The flags that give these processes to a process of the run (`--decodes` apart: the
    /// transfer scenario takes none).
    fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            "--deadline-ms".to_string(),
            self.deadline.as_millis().to_string(),
        ];
        if !self.platform.is_gpu() {
            args.push("--cpu".into());
        }
        if !self.gpus.is_empty() {
            args.push("--gpus".into());
            args.push(list(&self.gpus));
        }
        args
    }
}

/// The flags that give `shape` to a process of the run.
fn shape_args(shape: &Shape) -> Vec<String> {
    let mut args = vec![
        "--ranks".to_string(),
        shape.ranks.to_string(),
        "--layers".into(),
        shape.layers.to_string(),
        "--seed".into(),
        shape.seed.to_string(),
    ];
    if !shape.draft {
        args.push("--no-draft".into());
    }
    args
}

fn list(v: &[usize]) -> String {
    v.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// GPUs the driver sees (an error without a driver).
pub fn gpu_count() -> Result<usize> {
    if !kvshard::gpu::driver_present() {
        return Err(Error::NoDriver);
    }
    let driver = |call| move |source| Error::Driver { call, source };
    cudarc::driver::result::init().map_err(driver("cuInit"))?;
    let n = cudarc::driver::result::device::get_count().map_err(driver("cuDeviceGetCount"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// One run of the transfer scenario, identical in every process of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdConfig {
    /// The cache and the CP group: `ranks` prefill processes.
    pub shape: Shape,
    /// Where the processes run (one decode).
    pub processes: Processes,
    /// Request sizes in pages, one case each per method.
    pub pages: Vec<usize>,
    /// Pages per prefill chunk.
    pub chunk_pages: usize,
    /// The methods each size is sent with.
    pub methods: Vec<Method>,
    /// Requests per case (the first is verified).
    pub iterations: usize,
    /// Pause between a rank's chunks (tests use it to land a kill mid-request).
    pub pace: Duration,
}

/// One case: a request size and the method it is sent with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Case {
    /// Pages of the request.
    pub pages: usize,
    /// How ranks send it.
    pub method: Method,
}

/// The one-launch block copy at `ctas` CTAs of 512 threads: the `pd` scenarios' default shape
/// (`blocks:CTAS:THREADS` names others).
pub fn blocks(ctas: u32) -> Method {
    Method::Kernel(Launch {
        ctas,
        threads: kvshard::abi::KVS_COPY_THREADS.min(512),
    })
}

impl PdConfig {
    /// The default for the CPU twin (small, seconds) or GPUs (the production shape).
    pub fn default_for(platform: Platform) -> Self {
        let gpu = platform.is_gpu();
        Self {
            shape: Shape {
                ranks: 2,
                layers: if gpu { 61 } else { 4 },
                draft: true,
                seed: 7,
            },
            processes: Processes::new(platform, 1),
            pages: if gpu {
                vec![64, 512, 4096]
            } else {
                vec![9, 40]
            },
            chunk_pages: if gpu { 64 } else { 4 },
            methods: vec![
                blocks(if gpu { 32 } else { 2 }),
                Method::CopyEngine,
                Method::PerBlock,
            ],
            iterations: if gpu { 3 } else { 1 },
            pace: Duration::ZERO,
        }
    }

    /// Checks the run makes sense before any process starts: the shape, one decode, request
    /// sizes of a page or more, a method, an iteration, launch shapes the copy kernel takes.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidArgument(format!("pd: {why}")));
        self.shape.check()?;
        self.processes.check(self.shape.ranks)?;
        if self.processes.decodes != 1 {
            return bad(format!(
                "{} decodes: the transfer scenario has one",
                self.processes.decodes
            ));
        }
        // A request's tokens, and the decode pool's pages around it, are counted in `usize`.
        let fits = |pages: usize| {
            pages
                .checked_add(2)
                .and_then(|p| p.checked_mul(PAGE_SIZE))
                .is_some()
        };
        if self.pages.is_empty() || self.pages.iter().any(|&p| p == 0 || !fits(p)) {
            return bad(format!(
                "request sizes {:?} (each at least one page, and countable in tokens)",
                self.pages
            ));
        }
        if !fits(self.chunk_pages) {
            return bad(format!("chunks of {} pages", self.chunk_pages));
        }
        if self.methods.is_empty() || self.iterations == 0 || self.chunk_pages == 0 {
            return bad("no method, no iteration or empty chunks".into());
        }
        if self.pace >= self.processes.deadline {
            return bad(format!(
                "a pause of {} ms between chunks, not below the decode's deadline of {} ms: every \
                 request of more than one chunk would be overdue",
                self.pace.as_millis(),
                self.processes.deadline.as_millis()
            ));
        }
        // Requests are numbered case by case, iteration by iteration, and messages name both.
        let requests = self.cases().len().checked_mul(self.iterations);
        if requests.and_then(|n| u32::try_from(n).ok()).is_none() {
            return bad(format!(
                "{} cases x {} iterations",
                self.cases().len(),
                self.iterations
            ));
        }
        self.methods.iter().try_for_each(check_method)
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
        (self.max_pages().div_ceil(self.shape.ranks.max(1) as usize) + 2) as u64
    }

    /// Pages of the decode pool.
    pub fn decode_pages(&self) -> u64 {
        (self.max_pages() + 2) as u64
    }

    /// The prefill group's chain of a request of `pages` pages: every rank (and the decode's
    /// check) runs the rotated allocator identically from an empty pool.
    pub fn prefill_chain(&self, pages: usize) -> Result<RequestChain> {
        let placement = self.shape.placement()?;
        let mut allocator = ShardAllocator::new(placement, self.prefill_pages())?;
        let mut chain = RequestChain::new(placement);
        chain.grow_to(&mut allocator, Self::tokens(pages))?;
        Ok(chain)
    }

    /// The command-line flags that give this configuration (after `pd`).
    pub fn to_args(&self) -> Vec<String> {
        let mut args = shape_args(&self.shape);
        args.extend(self.processes.to_args());
        args.extend([
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
            "--pace-ms".into(),
            self.pace.as_millis().to_string(),
        ]);
        args
    }
}

/// A method as the command line names it: `blocks:CTAS:THREADS` (the block kernel),
/// `ranges:CTAS:THREADS` (the range kernel), `ce`, `naive` (per block); `batch` names the batched
/// copy engine, which no P/D transport runs.
pub fn method_name(method: &Method) -> String {
    match method {
        Method::Kernel(l) => format!("blocks:{}:{}", l.ctas, l.threads),
        Method::RangeKernel(l) => format!("ranges:{}:{}", l.ctas, l.threads),
        Method::CopyEngine => "ce".into(),
        Method::BatchedCopyEngine => "batch".into(),
        Method::PerBlock => "naive".into(),
    }
}

/// Parses [`method_name`]'s form (`blocks:CTAS` and `ranges:CTAS` take 512 threads) and checks
/// it ([`check_method`]).
pub fn parse_method(s: &str) -> Result<Method> {
    let bad = || {
        Error::InvalidArgument(format!(
            "method {s:?}: expected blocks:CTAS[:THREADS], ranges:CTAS[:THREADS], ce or naive"
        ))
    };
    let mut parts = s.split(':');
    let method = match parts.next() {
        Some("ce") if parts.next().is_none() => Method::CopyEngine,
        Some("naive") if parts.next().is_none() => Method::PerBlock,
        Some(kind @ ("blocks" | "ranges")) => {
            let ctas = parts.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
            let threads = match parts.next() {
                Some(t) => t.parse().map_err(|_| bad())?,
                None => 512,
            };
            if parts.next().is_some() {
                return Err(bad());
            }
            let launch = Launch { ctas, threads };
            if kind == "blocks" {
                Method::Kernel(launch)
            } else {
                Method::RangeKernel(launch)
            }
        }
        _ => return Err(bad()),
    };
    check_method(&method)?;
    Ok(method)
}

/// Checks a method the P/D transports run, and a kernel's launch shape against what the copy
/// kernels were compiled for (a device may allow fewer threads; the library refuses those when
/// it launches).
pub fn check_method(method: &Method) -> Result<()> {
    match method {
        Method::Kernel(launch) | Method::RangeKernel(launch) => {
            launch.validate(kvshard::abi::KVS_COPY_THREADS)
        }
        Method::CopyEngine | Method::PerBlock => Ok(()),
        Method::BatchedCopyEngine => Err(Error::UnsupportedMethod {
            method: method.to_string(),
            route: "a P/D transport",
            accepts: "blocks, ranges, ce or naive",
        }),
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
        let key = mix(self.seed
            ^ mix(u64::from(rank) << 48 ^ (component as u64) << 40 ^ (layer as u64) << 32)
            ^ page);
        let span = (self.bytes.len() - len.min(self.bytes.len())) as u64 + 1;
        let at = (key % span) as usize;
        &self.bytes[at..at + len.min(self.bytes.len())]
    }
}

/// The pattern of a run's geometry.
pub fn pattern(cfg: &PdConfig) -> Pattern {
    let max_block = cfg
        .shape
        .geometry()
        .components()
        .iter()
        .map(|c| c.block_bytes)
        .max()
        .unwrap_or(0);
    Pattern::new(cfg.shape.seed, max_block)
}

/// The bytes of one stored layer of component index `c` of `pool` (an allocated pool: layers
/// are slices of its storage).
pub(crate) fn layer_range(pool: &DevicePool, c: usize, layer: usize) -> Result<(usize, usize)> {
    let comp = &pool.components()[c];
    let storage = pool
        .storage()
        .ok_or_else(|| Error::InvalidArgument("pd pools are allocated by kvshard".into()))?;
    let base = pool.layer_bases(comp.component)?[layer];
    let offset = usize::try_from(base - storage.addr()).map_err(|_| overflow("a layer offset"))?;
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
    let placement = cfg.shape.placement()?;
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
    let window = usize::try_from(lo).map_err(|_| overflow("a page window"))?
        ..usize::try_from(hi.max(lo)).map_err(|_| overflow("a page window"))?;
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

/// The copy ceiling of a run, measured by the decode of `backend` against the GPU of the ranks'
/// `source`: the peer copy engine moving 1 GiB from `source` into the decode's GPU when they
/// differ, a local device copy of 1 GiB on one GPU, a 32 MiB copy on the CPU twin (indicative
/// only). Best of four (the first also touches every page).
pub(crate) fn ceiling(backend: &PeerBackend, source: usize) -> Result<Ceiling> {
    const RUNS: usize = 4;
    Ok(match backend {
        PeerBackend::Cpu(cpu) => {
            let t = copy_sync(
                &Timer::new(cpu.as_ref()),
                MemoryKind::Device,
                MemoryKind::Device,
                32 << 20,
                RUNS,
            )?;
            Ceiling {
                what: "CPU twin copy of 32 MiB (indicative only)".into(),
                gbps: t.best_gbps(),
                hardware: false,
            }
        }
        PeerBackend::Cuda(cuda) => {
            let here = cuda.gpu().info().ordinal;
            let (t, what) = if source == here {
                let t = copy_sync(
                    &Timer::new(cuda.as_ref()),
                    MemoryKind::Device,
                    MemoryKind::Device,
                    1 << 30,
                    RUNS,
                )?;
                (t, format!("local D2D copy on GPU {here}, 1 GiB"))
            } else {
                let t = peer_sync(cuda, &Gpu::open(source)?, 1 << 30, RUNS)?;
                (
                    t,
                    format!("peer copy engine GPU {source} -> GPU {here}, 1 GiB"),
                )
            };
            Ceiling {
                what,
                gbps: t.best_gbps(),
                hardware: true,
            }
        }
    })
}

/// The GPU rank 0 runs on: where a decode's ceiling copies from (0 on the CPU twin, which has
/// no GPU to name).
fn rank0_gpu(processes: &Processes, ranks: u32) -> Result<usize> {
    if !processes.platform.is_gpu() {
        return Ok(0);
    }
    Ok(processes.gpu_of(ranks, Role::Rank(0), gpu_count()?))
}

/// The decode process: allocates and publishes its pool, registers every request of every
/// case in turn, waits for each, verifies the first of each case and prints what it measured.
pub fn decode_role(cfg: &PdConfig, socket: &Path) -> Result<()> {
    cfg.validate()?;
    let (p, ranks) = (&cfg.processes, cfg.shape.ranks);
    let backend = p.open_backend(ranks, Role::Decode(0))?;
    let b = backend.backend();
    Message::Ceiling(ceiling(&backend, rank0_gpu(p, ranks)?)?).emit();
    let g = cfg.shape.geometry();
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
    let mut endpoint = DecodeEndpoint::bind(socket, backend.clone(), ranks, Liveness::default())?;
    endpoint.set_deadline(p.deadline);
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
            let registration = Registration::of_chain(&chain, request, PoolLayout::of(&pool), 0)?;
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
            Message::Received {
                case: case as u32,
                iteration: iteration as u32,
                wall_ms,
                bytes: finished.total_bytes().total(),
                verified,
            }
            .emit();
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
    let backend = cfg
        .processes
        .open_backend(cfg.shape.ranks, Role::Rank(rank))?;
    let b = backend.backend();
    let pool = Arc::new(DevicePool::allocate(
        b.as_ref(),
        &cfg.shape.geometry(),
        cfg.shape.placement()?,
        rank,
        cfg.prefill_pages(),
    )?);
    fill_pool_sync(b.as_ref(), &pool, &pattern(cfg))?;
    let first = cfg.methods.first().copied().unwrap_or(Method::CopyEngine);
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
        let mut sent = true;
        let b = self.backend.clone();
        let kernel_ms = time_sync(b.as_ref(), || {
            for (k, &end) in ends.iter().enumerate() {
                if k > 0 {
                    if !self.cfg.pace.is_zero() {
                        std::thread::sleep(self.cfg.pace);
                    }
                    // An abort (or the decode's end) between chunks stops the request here.
                    let events = self.endpoint.poll_sync(Duration::ZERO)?;
                    self.take(events);
                    if self.closed || self.aborted.contains(&request) {
                        sent = false;
                        return Ok(());
                    }
                }
                match self.endpoint.send(request, chain.pages()?, end) {
                    Ok(_) => {}
                    Err(Error::ChunkFailed { reason, .. }) => {
                        println!("rank {rank}: request {request} failed: {reason}");
                        self.summary.failed.push(request);
                        sent = false;
                        return Ok(());
                    }
                    // The decode is gone (its Closed event lists the request) or aborted it
                    // (its Aborted event does).
                    Err(Error::PeerGone { .. }) | Err(Error::Transfer { .. }) => {
                        sent = false;
                        return Ok(());
                    }
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })?;
        if !sent {
            return Ok(false);
        }
        let s = self.endpoint.stats();
        Message::Sent {
            case: case as u32,
            iteration: iteration as u32,
            kernel_ms,
            chunks: s.chunks - before.chunks,
            launches: s.launches - before.launches,
            copy_calls: s.copy_calls - before.copy_calls,
            descriptors: s.descriptors - before.descriptors,
            bytes: s.bytes - before.bytes,
        }
        .emit();
        Ok(true)
    }
}

/// A child process of the run, killed and reaped if the run ends before it does.
struct RoleProcess {
    role: Role,
    child: Child,
}

impl Drop for RoleProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits for every process; the first that fails (or a run past its time, or a process that
/// sent what is no message, which `refused` holds) gets the others killed. Returns what failed.
fn wait_all(
    processes: &mut [(RoleProcess, std::thread::JoinHandle<()>)],
    refused: &Mutex<Vec<String>>,
) -> Vec<String> {
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
                        failures.push(format!("{} exited with {status}", p.role));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    running[i] = false;
                    failures.push(format!("{}: {e}", p.role));
                }
            }
        }
        failures.append(&mut refused.lock().unwrap_or_else(|p| p.into_inner()));
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

/// What a run measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// The table, in markdown.
    pub markdown: String,
}

/// The socket path of this run (`kind` tells the scenarios apart).
fn socket_path(kind: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("kvshard-{kind}-{}.sock", std::process::id()))
}

/// Runs `cfg`: starts the N prefill processes and the decode (`exe pd --role ...`), forwards
/// what they print, and builds the table from their messages.
pub fn run(cfg: &PdConfig, exe: &Path) -> Result<Report> {
    cfg.validate()?;
    let socket = socket_path("pd");
    let mut args = vec!["pd".to_string()];
    args.extend(cfg.to_args());
    args.push("--socket".into());
    args.push(socket.display().to_string());
    let roles = (0..cfg.shape.ranks)
        .map(Role::Rank)
        .chain([Role::Decode(0)])
        .collect();
    let messages = run_roles(exe, &args, roles);
    let _ = std::fs::remove_file(&socket);
    Ok(Report {
        markdown: table(cfg, &messages?),
    })
}

/// The hidden flags that make a process of the run play `role`.
fn role_args(role: Role) -> [String; 4] {
    let (kind, index) = match role {
        Role::Rank(r) => ("prefill", r),
        Role::Decode(d) => ("decode", d),
    };
    [
        "--role".into(),
        kind.into(),
        "--rank".into(),
        index.to_string(),
    ]
}

/// Starts `exe ARGS ROLE_ARGS` for every role of `roles`, forwards what they print (prefixed
/// with the role) and returns their messages with the role of the process that sent each, once
/// every process has exited; the first that fails, a line that is no message where one should
/// be, or a run past its time gets the others killed and fails the run.
pub(crate) fn run_roles(
    exe: &Path,
    args: &[String],
    roles: Vec<Role>,
) -> Result<Vec<(Role, Message)>> {
    let messages: Arc<Mutex<Vec<(Role, Message)>>> = Arc::default();
    let refused: Arc<Mutex<Vec<String>>> = Arc::default();
    let spawn = |role: Role| -> Result<(RoleProcess, std::thread::JoinHandle<()>)> {
        let mut child = Command::new(exe)
            .args(args)
            .args(role_args(role))
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
        let (sink, refused) = (messages.clone(), refused.clone());
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout)
                .lines()
                .map_while(std::io::Result::ok)
            {
                match Message::from_line(&line, role) {
                    Ok(Some(message)) => sink
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((role, message)),
                    Ok(None) => println!("[{role}] {line}"),
                    Err(e) => refused
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(format!(
                            "{role} sent a message line that is none ({e}): {line}"
                        )),
                }
            }
        });
        Ok((RoleProcess { role, child }, reader))
    };
    let mut processes = Vec::with_capacity(roles.len());
    for role in roles {
        processes.push(spawn(role)?);
    }
    let mut failures = wait_all(&mut processes, &refused);
    for (_, reader) in processes {
        let _ = reader.join();
    }
    // A refusal read after the last process exited still fails the run.
    failures.append(&mut refused.lock().unwrap_or_else(|p| p.into_inner()));
    if !failures.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "pd run failed: {}",
            failures.join("; ")
        )));
    }
    let messages = std::mem::take(&mut *messages.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(messages)
}

/// The report table from the processes' messages.
fn table(cfg: &PdConfig, messages: &[(Role, Message)]) -> String {
    let ceiling = messages
        .iter()
        .find_map(|(_, m)| match m {
            Message::Ceiling(c) => Some(c.clone()),
            _ => None,
        })
        .unwrap_or(Ceiling {
            what: "none measured".into(),
            gbps: 0.0,
            hardware: false,
        });
    let shared_gpu = cfg.processes.ranks_share_a_gpu(cfg.shape.ranks);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} prefill rank(s) -> decode, {}, chunks of {} pages, {} iteration(s) per case; ceiling: {ceiling}; on the ranks' streams: bytes / {}\n",
        cfg.shape.ranks,
        cfg.shape,
        cfg.chunk_pages,
        cfg.iterations,
        if shared_gpu {
            "the sum of the ranks' stream times (they share a device and take turns on it)"
        } else {
            "the slowest rank's stream time"
        }
    );
    let _ = writeln!(
        out,
        "| pages | method | GB/s end to end | GB/s on the ranks' streams | % of ceiling (streams) | launches / chunk | copy calls / chunk | descriptors / chunk | verified |"
    );
    let _ = writeln!(out, "|---:|---|---:|---:|---:|---:|---:|---:|---|");
    for (case, c) in cfg.cases().into_iter().enumerate() {
        let case = case as u32;
        // (iteration, wall ms, bytes, verified) of every request of the case that arrived.
        let received: Vec<(u32, f64, u64, bool)> = messages
            .iter()
            .filter_map(|(_, m)| match *m {
                Message::Received {
                    case: k,
                    iteration,
                    wall_ms,
                    bytes,
                    verified,
                } if k == case => Some((iteration, wall_ms, bytes, verified)),
                _ => None,
            })
            .collect();
        // (iteration, kernel ms, chunks, launches, copy calls, descriptors) of every rank's send.
        let sent: Vec<(u32, f64, [u64; 4])> = messages
            .iter()
            .filter_map(|(_, m)| match *m {
                Message::Sent {
                    case: k,
                    iteration,
                    kernel_ms,
                    chunks,
                    launches,
                    copy_calls,
                    descriptors,
                    ..
                } if k == case => Some((
                    iteration,
                    kernel_ms,
                    [chunks, launches, copy_calls, descriptors],
                )),
                _ => None,
            })
            .collect();
        // Best iteration end to end; on the streams, each iteration's slowest rank (ranks on
        // distinct GPUs run at once) or the sum of the ranks (ranks sharing a GPU take turns on
        // it, so each rank's events time only its own turn), best of those.
        let bytes = received.iter().map(|r| r.2).max().unwrap_or(0);
        let wall = received.iter().map(|r| r.1).fold(f64::MAX, f64::min);
        let stream = (0..cfg.iterations as u32)
            .map(|i| {
                let ranks = sent.iter().filter(|s| s.0 == i).map(|s| s.1);
                if shared_gpu {
                    ranks.sum()
                } else {
                    ranks.fold(0.0, f64::max)
                }
            })
            .filter(|&ms| ms > 0.0)
            .fold(f64::MAX, f64::min);
        // Per chunk, over every rank's first iteration.
        let per_chunk = |k: usize| {
            let first = sent.iter().filter(|s| s.0 == 0);
            let chunks: u64 = first.clone().map(|s| s.2[0]).sum();
            let total: u64 = first.map(|s| s.2[k]).sum();
            if chunks > 0 {
                total as f64 / chunks as f64
            } else {
                0.0
            }
        };
        let verified = received.iter().any(|r| r.3);
        let stream_gbps = gbps(bytes, stream);
        let _ = writeln!(
            out,
            "| {} | {} | {:.1} | {:.1} | {} | {:.1} | {:.1} | {:.1} | {} |",
            c.pages,
            c.method,
            gbps(bytes, wall),
            stream_gbps,
            ceiling.share(stream_gbps),
            per_chunk(1),
            per_chunk(2),
            per_chunk(3),
            if verified { "byte-identical" } else { "NO" },
        );
    }
    out
}
