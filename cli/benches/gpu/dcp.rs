//! P/D into decode context parallelism (issue 37, docs/dcp.md): a request of `pages` pages sent
//! as one final chunk (latent KV and indexer state, 61-layer DeepSeek-V3.2 / GLM-5-shaped target
//! and the MTP draft, 576-byte rows) by each of N page-sharded prefill ranks sharing this GPU,
//! one after the other on the harness stream, into the M ranks of a decode server sharded by
//! token, I tokens at a time. The bytes are counted once (each byte read once and written once,
//! whatever a variant moves on the way), next to the same run's D2D ceiling, or with
//! `DCP_DECODE_GPU=G` the peer copy engine's ceiling from GPU 0 to GPU G. The decode ranks'
//! pools are exportable memory (`ipc::ExportedPool`) of this GPU, or of GPU G mapped into GPU
//! 0's context (as another process's pools are: `ipc::ImportedPool`), so the rows cross NVLink.
//! Variants:
//! - `scatter, Transport::submit_decode`: `BackendTransport::new`, one `kvs_decode_scatter`
//!   launch per prefill rank writing every decode rank's rows (its grid
//!   `Method::for_decode_scatter`'s);
//! - `..., a stream per prefill rank` (N > 1): the same with each prefill rank's transport on a
//!   stream of its own, the harness stream waiting for all. The ranks write the same decode
//!   pools through the same destinations, whose usage orders each launch after the one before
//!   (kvshard cannot see that their rows are disjoint), so they run one after another;
//! - `..., a stream and mappings per prefill rank` (N > 1): each rank on its own stream writing
//!   through a mapping of every decode pool of its own (`ipc::ImportedPool`), as separate
//!   prefill processes do: nothing orders one rank's launch after another's, so they overlap;
//! - `..., a stream and mappings per prefill rank, 1/S of the grid each` (N > 1; S = 2, and N
//!   where N > 2): the same on `Method::for_decode_scatter_shared(S)`'s grid, so S ranks'
//!   launches run side by side rather than the first taking every SM until its queue drains;
//! - `gather, then a copy per decode rank` (the obvious alternative, built from kvshard's other
//!   kernels, every table prepared before the timing): each rank's owned pages gathered into an
//!   unsharded staging buffer (one block copy), then per decode rank one block copy of its
//!   pages (I a multiple of 64) or one `kvs_copy_ranges` launch of a range per row and layer
//!   (a latent row, an indexer key and its scale).
//!
//! Notes give the host time per chunk (`submit_decode`, and building the chunk's `DecodePlan`
//! apart), launches and units. `--quick`: N = 2, 4 into M = 2, 4 at I = 1, 64, 512 pages (the
//! issue's matrix); without it also N = 8, M = 8, I = 16 and 64- and 4096-page requests.
//! `DCP_PAGES`, `DCP_N`, `DCP_M` and `DCP_I` (comma lists, e.g. `DCP_N=1,2`) replace an axis of
//! either matrix: a diagnosis picks its cases without a build of its own. Each variant's rows are
//! checked at random tokens against the prefill ranks' pages.

use std::sync::Arc;
use std::time::Instant;

use kvshard::abi;
use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::{Backend, Buffer, Launch, MemoryKind};
use kvshard::copy::{
    BlockCopy, BlockCopyPlan, BlockSpace, Method, PageSelection, RemoteSpace, Staging,
};
use kvshard::geometry::{
    CacheGeometry, LatentLayout, Model, INDEXER_HEAD_DIM, INDEXER_SCALES_OFFSET, PAGE_SIZE,
};
use kvshard::gpu::Gpu;
use kvshard::index::{LocalPage, LogicalPage, StoredLayer};
use kvshard::ipc::wire::Message;
use kvshard::ipc::{ExportedPool, ImportedPool, PeerBackend};
use kvshard::pool::DevicePool;
use kvshard::shard::{DecodeLayout, Placement};
use kvshard::transfer::{
    BackendTransport, ChunkRange, Completion, DecodePlan, DecodeRank, DecodeRegistration,
    PoolLayout, PrefillRank, Transport,
};
use kvshard::{Error, Result};
use kvshard_cli::measure::peer_sync;
use kvshard_cli::synth::POISON;
use rand::Rng;

use crate::harness::{fan_out, settle_sync, Ctx, Report};

const PAGE: u64 = PAGE_SIZE as u64;
/// The alternative's range tables past this many ranges are not built (a 4096-page request at
/// I = 1 would take ~49M ranges, 1.2 GB of tables).
const MOST_RANGES: usize = 8 << 20;

/// A range table of the alternative: its buffer, its ranges, and the staging and destination
/// its ranges lie in (held while it may run).
type RangeTable = (Buffer, u64, Arc<dyn BlockSpace>, Arc<dyn BlockSpace>);

/// One decode rank's pool: the backend that reads it as its own, the pool (exportable memory,
/// so each prefill rank may map it apart, as separate processes do), the destination the
/// prefill ranks write, and the export (with the mapping `space` goes through, on a peer).
struct Decode {
    owner: Arc<dyn Backend>,
    pool: Arc<DevicePool>,
    space: Arc<RemoteSpace>,
    exported: ExportedPool,
    _mapped: Option<ImportedPool>,
}

impl Decode {
    /// Another mapping of the pool into the harness GPU's context, with its own usage: what a
    /// prefill process that imported the pool itself writes through.
    fn map(&self, ctx: &Ctx) -> Result<ImportedPool> {
        let (msg, fds) = self.exported.publication(1)?;
        let Message::PublishPool(p) = msg else {
            return Err(Error::InvalidArgument("a pool publication".into()));
        };
        ImportedPool::import(&PeerBackend::Cuda(ctx.backend.clone()), &p, fds)
    }
}

/// Where the decode ranks' pools live.
enum DecodeGpu {
    /// On the harness GPU.
    Local,
    /// On GPU `ordinal`, mapped into the harness GPU's context.
    Peer {
        backend: Arc<CudaBackend>,
        ordinal: usize,
    },
}

impl DecodeGpu {
    fn pool(&self, ctx: &Ctx, g: &CacheGeometry, pages: u64) -> Result<Decode> {
        let (owner, on): (Arc<dyn Backend>, Arc<CudaBackend>) = match self {
            DecodeGpu::Local => (ctx.shared(), ctx.backend.clone()),
            DecodeGpu::Peer { backend, .. } => (backend.clone(), backend.clone()),
        };
        let exported =
            ExportedPool::allocate(&PeerBackend::Cuda(on), g, Placement::unsharded(), 0, pages)?;
        let pool = exported.pool().clone();
        let mut decode = Decode {
            owner,
            space: Arc::new(RemoteSpace::of(pool.clone(), g.clone())?),
            pool,
            exported,
            _mapped: None,
        };
        if let DecodeGpu::Peer { .. } = self {
            let mapped = decode.map(ctx)?;
            decode.space = mapped.space().clone();
            decode._mapped = Some(mapped);
        }
        Ok(decode)
    }
}

pub fn run(ctx: &mut Ctx, report: &mut Report) -> Result<()> {
    let g = Model::DeepseekV32.geometry(LatentLayout::Fp8Trtllm, true);
    let decode_gpu = match std::env::var("DCP_DECODE_GPU") {
        Ok(v) => {
            let ordinal: usize = v
                .parse()
                .map_err(|_| Error::InvalidArgument(format!("DCP_DECODE_GPU={v}")))?;
            let gpu = Gpu::open(ordinal)?;
            DecodeGpu::Peer {
                backend: Arc::new(CudaBackend::new(gpu)?),
                ordinal,
            }
        }
        Err(_) => DecodeGpu::Local,
    };
    let ceiling = match &decode_gpu {
        DecodeGpu::Local => ("d2d", ctx.ceilings.d2d),
        DecodeGpu::Peer { backend, ordinal } => {
            let t = peer_sync(backend, &ctx.gpu, 1 << 30, ctx.reps(10))?;
            report.header.push(format!(
                "dcp ceiling: peer copy engine GPU {} -> GPU {ordinal}, 1 GiB: {:.1} GB/s (best of the repeats)",
                ctx.gpu.info().ordinal,
                t.best_gbps()
            ));
            ("peer", t.best_gbps())
        }
    };
    let (sizes, ns, ms, is): (&[u64], &[u32], &[u32], &[u32]) = if ctx.quick {
        (&[512], &[2, 4], &[2, 4], &[1, 64])
    } else {
        (&[64, 512, 4096], &[2, 4, 8], &[2, 4, 8], &[1, 16, 64])
    };
    let sizes = axis("DCP_PAGES", sizes)?;
    let ns = axis("DCP_N", ns)?;
    let ms = axis("DCP_M", ms)?;
    let is = axis("DCP_I", is)?;
    for &pages in &sizes {
        for &n in &ns {
            for &m in &ms {
                for &i in &is {
                    case(
                        ctx,
                        report,
                        &g,
                        &decode_gpu,
                        ceiling,
                        pages,
                        n,
                        DecodeLayout::new(m, i)?,
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// Who submits the prefill ranks' chunks.
enum Senders {
    /// One transport on the harness stream, the chunks one after the other.
    One(BackendTransport),
    /// A transport on a stream of its own per prefill rank (the transports, then their
    /// streams) ([`fan_out`]), through the same destinations: their usage orders each rank's
    /// launch after the one before.
    PerRank(Vec<BackendTransport>, Vec<Arc<dyn Backend>>),
    /// The same, each prefill rank also writing through a mapping of every decode pool of its
    /// own (each rank's destinations, then the mappings), as separate processes do: no usage
    /// orders one rank's launch after another's, so their launches may run at once.
    Apart {
        transports: Vec<BackendTransport>,
        streams: Vec<Arc<dyn Backend>>,
        views: Vec<Vec<Arc<RemoteSpace>>>,
        _mapped: Vec<ImportedPool>,
    },
}

/// The scatter's row: every prefill rank's chunk through `submit_decode`, timed, then the
/// decode ranks checked.
#[allow(clippy::too_many_arguments)]
fn scatter(
    ctx: &mut Ctx,
    report: &mut Report,
    (case, label): (&str, &str),
    mut senders: Senders,
    (ranks, src, plans): (&[Arc<DevicePool>], &[LogicalPage], &[DecodePlan]),
    (decode, dsts, reg): (&[Decode], &[Arc<RemoteSpace>], &DecodeRegistration),
    (bytes, reps, ceiling, plan_us): (u64, usize, (&'static str, f64), f64),
    layout: DecodeLayout,
) -> Result<()> {
    let backend = ctx.shared();
    let n = ranks.len() as u32;
    poison(decode)?;
    let mut pending: Vec<Box<dyn Completion>> = Vec::new();
    let stats = ctx.time(reps, || {
        match &mut senders {
            Senders::One(transport) => {
                for (plan, pool) in plans.iter().zip(ranks) {
                    pending.push(transport.submit_decode(plan, pool, dsts)?);
                }
            }
            Senders::PerRank(transports, streams) => {
                pending.extend(fan_out(backend.as_ref(), streams, |i| {
                    transports[i].submit_decode(&plans[i], &ranks[i], dsts)
                })?);
            }
            Senders::Apart {
                transports,
                streams,
                views,
                ..
            } => {
                pending.extend(fan_out(backend.as_ref(), streams, |i| {
                    transports[i].submit_decode(&plans[i], &ranks[i], &views[i])
                })?);
            }
        }
        Ok(())
    })?;
    settle_sync(backend.as_ref(), pending)?;
    verify(ctx, ranks, src, decode, reg, "scatter")?;
    let units: u64 = plans
        .iter()
        .zip(ranks)
        .map(|(plan, pool)| {
            let refs: Vec<&dyn BlockSpace> = dsts.iter().map(|d| d.as_ref() as _).collect();
            plan.scatter(pool.as_ref(), &refs).map(|s| s.units())
        })
        .sum::<Result<u64>>()?;
    let per = f64::from(n);
    report.add(
        "dcp",
        format!("{case}, scatter, Transport::submit_decode{label}"),
        bytes,
        stats,
        ceiling,
        format!(
            "{n} kvs_decode_scatter launches (1 per chunk, {} kernel), {units} (page, layer pair) units; host {:.1} us per submit_decode, {plan_us:.1} us per DecodePlan::new; window {:.3} ms for {n} chunks",
            if layout.is_page_granular() { "pages" } else { "rows" },
            stats.view.host_us / per,
            stats.view.window.median
        ),
    );
    Ok(())
}

/// Who submits the scatter in each of its rows, and the row's label, as `Sender::send` submits
/// each rank's chunk: with the grid kvshard picks, then with each grid DCP_GRID names; then
/// (N > 1) with those grids again, a stream per prefill rank, and a stream and mappings per
/// prefill rank; last (N > 1) a stream and mappings per prefill rank on
/// `Method::for_decode_scatter_shared`'s grid for two launches at once, then (N > 2) for N.
fn senders(ctx: &Ctx, n: u32, decode: &[Decode]) -> Result<Vec<(Senders, String)>> {
    let grids = axis::<String>("DCP_GRID", &[])?
        .iter()
        .map(|g| grid(g))
        .collect::<Result<Vec<_>>>()?;
    let mut methods: Vec<(Option<Method>, String)> = vec![(None, String::new())];
    methods.extend(grids.iter().map(|&l| {
        (
            Some(Method::Kernel(l)),
            format!(" ({}x{})", l.ctas, l.threads),
        )
    }));
    let mut runs = Vec::new();
    for (method, label) in &methods {
        runs.push((
            Senders::One(transport(ctx.shared(), *method)?),
            label.clone(),
        ));
    }
    for (method, label) in methods.iter().filter(|_| n > 1) {
        let (transports, streams) = rank_streams(ctx, n, *method)?;
        runs.push((
            Senders::PerRank(transports, streams),
            format!("{label}, a stream per prefill rank"),
        ));
        runs.push((
            apart(ctx, n, *method, decode)?,
            format!("{label}, a stream and mappings per prefill rank"),
        ));
    }
    // Two ranks' launches at once, then (N > 2) all N at once.
    let shares = match n {
        0 | 1 => vec![],
        2 => vec![2],
        _ => vec![2, n],
    };
    for at_once in shares {
        let shared = Method::for_decode_scatter_shared(ctx.backend.as_ref(), at_once)?;
        runs.push((
            apart(ctx, n, Some(shared), decode)?,
            format!(", a stream and mappings per prefill rank, 1/{at_once} of the grid each"),
        ));
    }
    Ok(runs)
}

/// [`Senders::Apart`]: `n` prefill ranks, each with a stream, a transport (`method`) and a
/// mapping of every decode pool of its own.
fn apart(ctx: &Ctx, n: u32, method: Option<Method>, decode: &[Decode]) -> Result<Senders> {
    let (transports, streams) = rank_streams(ctx, n, method)?;
    let mut views = Vec::new();
    let mut mapped = Vec::new();
    for _ in 0..n {
        let mut view = Vec::new();
        for d in decode {
            let m = d.map(ctx)?;
            view.push(m.space().clone());
            mapped.push(m);
        }
        views.push(view);
    }
    Ok(Senders::Apart {
        transports,
        streams,
        views,
        _mapped: mapped,
    })
}

/// A transport on `backend`: with kvshard's grid, or `method`.
fn transport(backend: Arc<dyn Backend>, method: Option<Method>) -> Result<BackendTransport> {
    match method {
        None => Ok(BackendTransport::new(backend)),
        Some(m) => BackendTransport::with_method(backend, m),
    }
}

/// A transport per prefill rank, and the stream each enqueues on.
type RankStreams = (Vec<BackendTransport>, Vec<Arc<dyn Backend>>);

/// `n` streams of the harness GPU, and a transport on each ([`transport`]).
fn rank_streams(ctx: &Ctx, n: u32, method: Option<Method>) -> Result<RankStreams> {
    let streams = (0..n)
        .map(|_| Ok(Arc::new(CudaBackend::new(ctx.gpu.clone())?) as Arc<dyn Backend>))
        .collect::<Result<Vec<_>>>()?;
    let transports = streams
        .iter()
        .map(|s| transport(s.clone(), method))
        .collect::<Result<_>>()?;
    Ok((transports, streams))
}

/// A grid written `CTASxTHREADS`.
fn grid(text: &str) -> Result<Launch> {
    let bad = || Error::InvalidArgument(format!("DCP_GRID: {text} (CTASxTHREADS)"));
    let (ctas, threads) = text.split_once('x').ok_or_else(bad)?;
    Ok(Launch {
        ctas: ctas.parse().map_err(|_| bad())?,
        threads: threads.parse().map_err(|_| bad())?,
    })
}

/// The matrix's axis `var` names, or `default` where it is unset.
fn axis<T: Clone + std::str::FromStr>(var: &str, default: &[T]) -> Result<Vec<T>> {
    match std::env::var(var) {
        Ok(list) => list
            .split(',')
            .map(|v| {
                v.trim()
                    .parse()
                    .map_err(|_| Error::InvalidArgument(format!("{var}={list}")))
            })
            .collect(),
        Err(_) => Ok(default.to_vec()),
    }
}

/// One (pages, N, layout): its prefill ranks, decode ranks and plans, then every variant.
#[allow(clippy::too_many_arguments)]
fn case(
    ctx: &mut Ctx,
    report: &mut Report,
    g: &CacheGeometry,
    decode_gpu: &DecodeGpu,
    ceiling: (&'static str, f64),
    pages: u64,
    n: u32,
    layout: DecodeLayout,
) -> Result<()> {
    let backend = ctx.shared();
    let placement = Placement::new(n)?;
    let shard = u64::from(n);
    // A fresh prefill group: position j at the next local page of owner j % n.
    let src: Vec<LogicalPage> = (0..pages)
        .map(|j| LogicalPage((j / shard + 1) * shard + j % shard))
        .collect();
    let ranks: Vec<Arc<DevicePool>> = (0..n)
        .map(|r| {
            DevicePool::allocate(backend.as_ref(), g, placement, r, pages.div_ceil(shard) + 1)
                .map(Arc::new)
        })
        .collect::<Result<_>>()?;
    for pool in &ranks {
        let storage = pool
            .storage()
            .ok_or_else(|| Error::InvalidArgument("an allocated pool".into()))?
            .clone();
        ctx.fill_random(&storage)?;
    }
    let tokens = pages * PAGE;
    let (decode, reg) = decode_ranks(ctx, g, decode_gpu, layout, tokens)?;
    let chunk = ChunkRange {
        index: 0,
        start: 0,
        end: tokens as usize,
        last: true,
    };
    let plan_started = Instant::now();
    let plans: Vec<DecodePlan> = ranks
        .iter()
        .map(|pool| DecodePlan::new(&PrefillRank::of(pool), &src, &reg, chunk))
        .collect::<Result<_>>()?;
    let plan_us = plan_started.elapsed().as_secs_f64() * 1e6 / f64::from(n);
    let bytes: u64 = plans.iter().map(|p| p.bytes().total()).sum();
    let dsts: Vec<Arc<RemoteSpace>> = decode.iter().map(|d| d.space.clone()).collect();
    let case = format!(
        "N={n} into M={} I={}, {pages} pages x 62+62 layers",
        layout.ranks(),
        layout.interleave()
    );
    let reps = ctx.reps(if pages >= 4096 { 5 } else { 20 });

    for (senders, label) in senders(ctx, n, &decode)? {
        scatter(
            ctx,
            report,
            (&case, &label),
            senders,
            (&ranks, &src, &plans),
            (&decode, &dsts, &reg),
            (bytes, reps, ceiling, plan_us),
            layout,
        )?;
    }

    alternative(
        ctx,
        report,
        &case,
        ceiling,
        (&ranks, &src, &plans),
        &decode,
        &reg,
        bytes,
        reps,
    )
}

/// The decode ranks of `layout` for a request of `tokens` tokens, each holding its share at
/// its pages 1, 2, ..., and the request's registration with them.
fn decode_ranks(
    ctx: &mut Ctx,
    g: &CacheGeometry,
    decode_gpu: &DecodeGpu,
    layout: DecodeLayout,
    tokens: u64,
) -> Result<(Vec<Decode>, DecodeRegistration)> {
    let mut decode = Vec::new();
    let mut dranks = Vec::new();
    for d in 0..layout.ranks() {
        let share = layout.pages_on(d, tokens);
        let side = decode_gpu.pool(ctx, g, share + 1)?;
        let list: Vec<LocalPage> = (1..=share).map(LocalPage).collect();
        dranks.push(DecodeRank {
            layout: PoolLayout::of(&side.pool),
            pages: list.clone(),
            state_pages: list,
        });
        decode.push(side);
    }
    let reg = DecodeRegistration {
        request: 1,
        layout,
        tokens: tokens as usize,
        prefix_pages: 0,
        ranks: dranks,
    };
    Ok((decode, reg))
}

/// One run of the alternative: the gathers into staging, then the copies out of it (block
/// copies, or range tables).
fn run_alternative(
    backend: &dyn Backend,
    launch: Launch,
    gathers: &[BlockCopy],
    scatters: &[BlockCopy],
    tables: &[RangeTable],
) -> Result<()> {
    for gather in gathers {
        gather.run(backend, launch)?;
    }
    for scatter in scatters {
        scatter.run(backend, launch)?;
    }
    for (table, count, _, _) in tables {
        let p = abi::kvs_copy_ranges_params {
            ranges: table.addr(),
            num_ranges: *count,
            status: abi::kvs_status::default(),
        };
        // SAFETY: every range lies inside a block of a staging buffer (held in `tables`)
        // or of a decode rank's destination (held there too, and its memory by `decode`),
        // both in this GPU's address space and alive past the synchronize below; each
        // table holds `count` ranges.
        unsafe { backend.copy_ranges(p, launch)? };
    }
    Ok(())
}

/// Poisons every decode rank's pool, and waits for it: the variant after writes on another
/// stream (and maybe GPU), which nothing else orders.
fn poison(decode: &[Decode]) -> Result<()> {
    for d in decode {
        d.pool.fill(d.owner.as_ref(), POISON)?;
        d.owner.synchronize()?;
    }
    Ok(())
}

/// The obvious alternative: every rank's owned pages gathered into an unsharded staging
/// buffer, then one copy per decode rank out of it (module docs).
#[allow(clippy::too_many_arguments)]
fn alternative(
    ctx: &mut Ctx,
    report: &mut Report,
    case: &str,
    ceiling: (&'static str, f64),
    (ranks, src, plans): (&[Arc<DevicePool>], &[LogicalPage], &[DecodePlan]),
    decode: &[Decode],
    reg: &DecodeRegistration,
    bytes: u64,
    reps: usize,
) -> Result<()> {
    let backend = ctx.shared();
    let g = ranks[0].geometry().clone();
    let layout = reg.layout;
    let fallback = Launch {
        ctas: 264,
        threads: 512,
    };
    let launch = Method::default_for(backend.as_ref())
        .launch()
        .unwrap_or(fallback);
    let mut gathers = Vec::new();
    let mut scatters = Vec::new();
    let mut tables: Vec<RangeTable> = Vec::new();
    let mut ranges = 0usize;
    let started = Instant::now();
    for (plan, pool) in plans.iter().zip(ranks) {
        // The owned pages in position order (the state section covers every owned position).
        let entries = plan.state().entries();
        let staging: Arc<dyn BlockSpace> = Arc::new(Staging::new(
            backend.as_ref(),
            &g,
            entries.len().max(1) as u64,
        )?);
        let gather = BlockCopyPlan::new(
            pool.as_ref(),
            PageSelection::Local(entries.iter().map(|e| e.0).collect()),
            staging.as_ref(),
            PageSelection::Positions,
            entries.len(),
        )?;
        let pool_space: Arc<dyn BlockSpace> = pool.clone();
        gathers.push(BlockCopy::prepare_sync(
            backend.as_ref(),
            gather,
            pool_space,
            staging.clone(),
            None,
        )?);
        for (d, side) in (0u32..).zip(decode) {
            let rank = &reg.ranks[d as usize];
            let dst: Arc<dyn BlockSpace> = side.space.clone();
            if layout.is_page_granular() {
                // The staging entries whose page lands on rank d, whole.
                let (from, to): (Vec<LocalPage>, Vec<LocalPage>) = (0u64..)
                    .zip(entries)
                    .filter_map(|(j, &(_, position))| {
                        let at = layout.place(position * PAGE);
                        (at.rank == d).then(|| (LocalPage(j), rank.pages[at.page_index() as usize]))
                    })
                    .unzip();
                let copy = BlockCopyPlan::new(
                    staging.as_ref(),
                    PageSelection::Local(from.clone()),
                    dst.as_ref(),
                    PageSelection::Local(to),
                    from.len(),
                )?;
                scatters.push(BlockCopy::prepare_sync(
                    backend.as_ref(),
                    copy,
                    staging.clone(),
                    dst,
                    None,
                )?);
            } else {
                let table =
                    row_ranges(&g, staging.as_ref(), dst.as_ref(), entries, layout, d, rank)?;
                ranges += table.len() / 24;
                if ranges > MOST_RANGES {
                    report.header.push(format!(
                        "dcp {case}: the alternative skipped (more than {MOST_RANGES} ranges)"
                    ));
                    return Ok(());
                }
                let buffer = backend.alloc(table.len().max(24), MemoryKind::Device)?;
                backend.write_sync(&buffer, 0, &table)?;
                tables.push((buffer, (table.len() / 24) as u64, staging.clone(), dst));
            }
        }
    }
    let build_ms = started.elapsed().as_secs_f64() * 1e3;
    poison(decode)?;
    let stats = ctx.time(reps, || {
        run_alternative(backend.as_ref(), launch, &gathers, &scatters, &tables)
    })?;
    backend.synchronize()?;
    verify(ctx, ranks, src, decode, reg, "gather then per-rank copies")?;
    let n = ranks.len();
    let how = copies_out(layout, scatters.len(), tables.len(), ranges);
    report.add(
        "dcp",
        format!("{case}, gather, then a copy per decode rank"),
        bytes,
        stats,
        ceiling,
        format!(
            "{n} block-copy gathers into unsharded staging, then {how}, {launch_ctas}x{launch_threads}; every byte moved twice, counted once; tables built in {build_ms:.1} ms",
            launch_ctas = launch.ctas,
            launch_threads = launch.threads
        ),
    );
    Ok(())
}

/// How the alternative copies out of its staging: block copies (page-granular layouts), or
/// range tables.
fn copies_out(layout: DecodeLayout, scatters: usize, tables: usize, ranges: usize) -> String {
    if layout.is_page_granular() {
        format!("{scatters} block copies out")
    } else {
        format!(
            "{tables} kvs_copy_ranges launches out, {ranges} ranges ({} MB of tables, uploaded before the timing)",
            (24 * ranges) >> 20
        )
    }
}

/// One range per row and layer from `staging` (entry `j`: sequence page `entries[j].1`) to
/// decode rank `d`'s rows: a latent row, an indexer key and its scale; little-endian
/// `kvs_range`s.
fn row_ranges(
    g: &CacheGeometry,
    staging: &dyn BlockSpace,
    dst: &dyn BlockSpace,
    entries: &[(LocalPage, u64)],
    layout: DecodeLayout,
    d: u32,
    rank: &DecodeRank,
) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut push = |s: u64, t: u64, len: u64| {
        for w in [s, t, len] {
            out.extend_from_slice(&w.to_le_bytes());
        }
    };
    for comp in g.components() {
        for layer in 0..comp.layers() {
            let layer = StoredLayer(layer);
            for (j, &(_, position)) in (0u64..).zip(entries) {
                let from = staging.block_addr(comp.component, layer, LocalPage(j))?;
                for o in 0..PAGE {
                    let at = layout.place(position * PAGE + o);
                    if at.rank != d {
                        continue;
                    }
                    let page = rank.pages[at.page_index() as usize];
                    let to = dst.block_addr(comp.component, layer, page)?;
                    if comp.component.is_indexer() {
                        let key = INDEXER_HEAD_DIM as u64;
                        push(from + o * key, to + at.row() * key, key);
                        let scales = INDEXER_SCALES_OFFSET as u64;
                        push(from + scales + 4 * o, to + scales + 4 * at.row(), 4);
                    } else {
                        let row = comp.row_bytes as u64;
                        push(from + o * row, to + at.row() * row, row);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Compares 16 random tokens of every component's first and last layer: the row on its decode
/// rank against the owning prefill rank's page.
fn verify(
    ctx: &mut Ctx,
    ranks: &[Arc<DevicePool>],
    src: &[LogicalPage],
    decode: &[Decode],
    reg: &DecodeRegistration,
    variant: &str,
) -> Result<()> {
    let backend = ctx.shared();
    let placement = ranks[0].placement();
    let layout = reg.layout;
    for comp in ranks[0].components() {
        for layer in [0, comp.layers() - 1].map(StoredLayer) {
            for _ in 0..16 {
                let t = ctx.rng.random_range(0..reg.tokens as u64);
                let page = src[(t / PAGE) as usize];
                let owner = &ranks[placement.owner(page) as usize];
                let sent = owner.read_block_sync(
                    backend.as_ref(),
                    comp.component,
                    layer,
                    placement.local(page),
                )?;
                let at = layout.place(t);
                let side = &decode[at.rank as usize];
                let to = reg.ranks[at.rank as usize].pages[at.page_index() as usize];
                let landed =
                    side.pool
                        .read_block_sync(side.owner.as_ref(), comp.component, layer, to)?;
                let (o, row) = ((t % PAGE) as usize, at.row() as usize);
                let same = if comp.component.is_indexer() {
                    let (key, scales) = (INDEXER_HEAD_DIM, INDEXER_SCALES_OFFSET);
                    sent[o * key..(o + 1) * key] == landed[row * key..(row + 1) * key]
                        && sent[scales + 4 * o..scales + 4 * o + 4]
                            == landed[scales + 4 * row..scales + 4 * row + 4]
                } else {
                    let r = comp.row_bytes;
                    sent[o * r..(o + 1) * r] == landed[row * r..(row + 1) * r]
                };
                if !same {
                    return Err(Error::InvalidArgument(format!(
                        "{variant}: {} {layer} token {t} did not land on decode rank {}",
                        comp.component, at.rank
                    )));
                }
            }
        }
    }
    Ok(())
}
