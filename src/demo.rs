//! The end-to-end job `kvshard demo` runs: one request through every stage of the data plane,
//! on whichever backend is there, checking the bytes at every hand-off.
//!
//! 1. The N prefill ranks of a CP group grow a request's page chain chunk by chunk with the
//!    rotated-owner allocator; an unsharded reference prefill does the same for itself.
//! 2. Each chunk's KV (random bf16 rows, FP8-quantized by the quantizer kernels into the chunk
//!    staging) is persisted by every rank's owned-row write path and by the reference.
//! 3. P/D: every rank sends every chunk (plus the indexer state with the final one) to a decode
//!    pool; the decode pool must equal the one the unsharded reference sends.
//! 4. HiCache: every rank backs its pages up to a pinned host pool, loses them (poisoned and
//!    freed), reloads them into newly allocated pages of the same owners, and sends again: the
//!    decode pool must still be identical.

use std::time::Instant;

use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::backend::Launch;
use crate::backend::{Backend, MemoryKind};
use crate::error::{Error, Result};
use crate::geometry::IndexerScale;
use crate::geometry::{CacheGeometry, LatentLayout, PoolGeometry, PAGE_SIZE};
use crate::hicache::{
    Direction, HostLayout, HostPool, HostTransfer, IoBackend, Layers, Relayout, TransferPlan,
};
use crate::pool::{ChunkStaging, DevicePool, OwnedRowWrite};
use crate::quantize::{
    quantize_indexer, quantize_latent, INDEXER_INPUT_ROW_BYTES, LATENT_INPUT_ROW_BYTES,
};
use crate::shard::{AllocRequest, ChainStart, Placement, ShardAllocator};
use crate::synth::{self, POISON};
use crate::transfer::{
    BackendTransport, ChunkEnd, CopyMethod, PoolLayout, Receiver, Registration, Sender,
};

/// What the demo runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// CP shard size N.
    pub ranks: u32,
    /// Target layers (every fourth one shares its indexer).
    pub layers: usize,
    /// Whether the single-layer MTP draft pool is present.
    pub draft: bool,
    /// Request length in tokens.
    pub tokens: usize,
    /// Prefill chunk size in tokens (a multiple of 64).
    pub chunk: usize,
    /// Seed of the synthetic KV.
    pub seed: u64,
}

impl Config {
    /// The default for a backend: production shape on the GPU, a small one on the CPU reference.
    pub fn default_for(gpu: bool) -> Self {
        if gpu {
            Self {
                ranks: 4,
                layers: 61,
                draft: true,
                tokens: 16_000,
                chunk: 4096,
                seed: 7,
            }
        } else {
            Self {
                ranks: 4,
                layers: 4,
                draft: true,
                tokens: 1000,
                chunk: 256,
                seed: 7,
            }
        }
    }
}

/// What the demo did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    /// Lines of the report, in order.
    pub lines: Vec<String>,
}

impl Summary {
    fn say(&mut self, line: String) {
        println!("{line}");
        self.lines.push(line);
    }
}

/// How HiCache moves bytes in the demo: the staged copy-engine path where a second stream is
/// given, else the coalesced copy engine.
fn hicache_io<B: Backend>(
    t: &mut HostTransfer<'_>,
    b: &B,
    relayout: &B,
    staged: bool,
) -> Result<()> {
    if staged {
        t.prepare_kernel(b, None)?;
        let staging = t.staging(b, 16)?;
        t.run_staged(b, relayout, &staging, Relayout::Kernel { ctas: 8 })?;
        // The staging buffers are dropped on return: everything must have landed.
        b.synchronize()
    } else {
        t.run(b, IoBackend::CopyEngine, Layers::All)?;
        b.synchronize()
    }
}

/// Logical slots of sequence positions `range` in a chain of logical pages.
fn slots(chain: &[u64], range: std::ops::Range<usize>) -> Vec<i64> {
    range
        .map(|p| (chain[p / PAGE_SIZE] * PAGE_SIZE as u64 + (p % PAGE_SIZE) as u64) as i64)
        .collect()
}

/// Grows `chain` to cover `tokens` tokens.
fn grow(
    alloc: &mut ShardAllocator,
    chain: &mut Vec<u64>,
    start: &mut u32,
    tokens: usize,
) -> Result<()> {
    let need = tokens.div_ceil(PAGE_SIZE).saturating_sub(chain.len());
    if need == 0 {
        return Ok(());
    }
    let chain_start = if chain.is_empty() {
        ChainStart::New
    } else {
        ChainStart::Extend {
            start_owner: *start,
            prefix_tokens: chain.len() * PAGE_SIZE,
        }
    };
    let a = alloc.alloc(AllocRequest {
        chain: chain_start,
        pages: need,
    })?;
    *start = a.start_owner;
    chain.extend(a.pages);
    Ok(())
}

/// Sends the whole request from every `pools[r]` (with chain `chain`) to `decode`.
fn send_all<B: Backend>(
    b: &B,
    pools: &[DevicePool],
    chain: &[u64],
    decode: &DevicePool,
    reg: &Registration,
    chunk: usize,
    tokens: usize,
) -> Result<u64> {
    let mut receiver = Receiver::new();
    receiver.register(reg.clone(), pools.len() as u32)?;
    let mut transport = BackendTransport::new(
        b,
        CopyMethod::Blocks(Launch {
            ctas: 264,
            threads: 512,
        }),
    );
    let mut senders: Vec<Sender<'_>> = pools.iter().map(Sender::new).collect();
    for s in &mut senders {
        s.open(reg.clone())?;
    }
    let mut finished = None;
    let mut end = 0;
    while end < tokens {
        end = (end + chunk).min(tokens);
        let last = end == tokens;
        for s in &mut senders {
            let status = s.send(
                &mut transport,
                decode,
                reg.request,
                chain,
                if last {
                    ChunkEnd::Final(end)
                } else {
                    ChunkEnd::Partial(end)
                },
            )?;
            if let Some(f) = receiver.receive(status)? {
                finished = Some(f);
            }
        }
    }
    let f = finished.ok_or_else(|| Error::Transfer {
        request: reg.request,
        reason: "no final status from every rank".into(),
    })?;
    if !f.is_completed() {
        return Err(Error::Transfer {
            request: reg.request,
            reason: "request failed".into(),
        });
    }
    Ok(f.total_bytes().total())
}

/// Runs the demo on `b` (with `relayout`, a second stream of the same device, for the staged
/// HiCache path when `staged`).
pub fn run<B: Backend>(b: &B, relayout: &B, cfg: &Config, staged: bool) -> Result<Summary> {
    let mut out = Summary::default();
    if cfg.chunk == 0 || cfg.chunk % PAGE_SIZE != 0 || cfg.tokens == 0 {
        return Err(Error::InvalidArgument(format!(
            "chunk of {} tokens (a non-zero multiple of 64) for {} tokens",
            cfg.chunk, cfg.tokens
        )));
    }
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let target = PoolGeometry::with_indexer_layers(
        LatentLayout::Fp8Trtllm,
        (0..cfg.layers).map(|i| i % 4 != 3).collect(),
    );
    let g = if cfg.draft {
        CacheGeometry::with_draft(target)
    } else {
        CacheGeometry::target_only(target)
    };
    let placement = Placement::new(cfg.ranks)?;
    let pages = cfg.tokens.div_ceil(PAGE_SIZE);
    let per_rank = (pages.div_ceil(cfg.ranks as usize) + 2) as u64;
    out.say(format!(
        "kvshard demo on the {} backend: {} tokens, chunks of {}, CP{} ({} layers{}, {} indexer layers, {} B per page)",
        b.name(),
        cfg.tokens,
        cfg.chunk,
        cfg.ranks,
        cfg.layers,
        if cfg.draft { " + MTP draft" } else { "" },
        g.target.num_indexer_layers(),
        g.page_bytes()
    ));

    // 1 + 2: allocate and prefill, chunk by chunk.
    let t = Instant::now();
    let ranks: Vec<DevicePool> = (0..cfg.ranks)
        .map(|r| DevicePool::allocate(b, &g, placement, r, per_rank))
        .collect::<Result<_>>()?;
    let reference = DevicePool::allocate(b, &g, Placement::unsharded(), 0, pages as u64 + 2)?;
    let mut alloc = ShardAllocator::new(placement, per_rank)?;
    let mut ref_alloc = ShardAllocator::new(Placement::unsharded(), pages as u64 + 2)?;
    let (mut chain, mut ref_chain) = (Vec::new(), Vec::new());
    let (mut start, mut ref_start) = (0, 0);
    let staging = ChunkStaging::new(b, &reference, cfg.chunk)?;
    let writes: Vec<OwnedRowWrite<'_>> = ranks
        .iter()
        .chain(std::iter::once(&reference))
        .map(|p| OwnedRowWrite::prepare(b, &staging, p, |_| true))
        .collect::<Result<_>>()?;
    let mut written = 0u64;
    let mut begin = 0;
    while begin < cfg.tokens {
        let end = (begin + cfg.chunk).min(cfg.tokens);
        let n = end - begin;
        grow(&mut alloc, &mut chain, &mut start, end)?;
        grow(&mut ref_alloc, &mut ref_chain, &mut ref_start, end)?;
        // The chunk's KV: random bytes in every layer, FP8-quantized random rows in layer 0.
        b.write(
            staging.buffer(),
            0,
            &synth::bytes(&mut rng, staging.buffer().len()),
        )?;
        let rows: Vec<i64> = (0..n as i64).collect();
        let latent_in = b.alloc(n * LATENT_INPUT_ROW_BYTES, MemoryKind::Device)?;
        b.write(
            &latent_in,
            0,
            &synth::bf16_bytes(&mut rng, n * LATENT_INPUT_ROW_BYTES / 2),
        )?;
        quantize_latent(
            b,
            LatentLayout::Fp8Trtllm,
            &latent_in,
            &rows,
            &staging.layer(0, 0)?,
        )?;
        let keys_in = b.alloc(n * INDEXER_INPUT_ROW_BYTES, MemoryKind::Device)?;
        b.write(
            &keys_in,
            0,
            &synth::bf16_bytes(&mut rng, n * INDEXER_INPUT_ROW_BYTES / 2),
        )?;
        quantize_indexer(
            b,
            IndexerScale::Ue8m0,
            &keys_in,
            &rows,
            &staging.layer(1, 0)?,
        )?;
        for (r, w) in writes.iter().enumerate() {
            let s = if r < ranks.len() {
                slots(&chain, begin..end)
            } else {
                slots(&ref_chain, begin..end)
            };
            w.run_checked(b, &s, w.launch(n))?;
            if r < ranks.len() {
                let owned = s
                    .iter()
                    .filter(|&&x| placement.slot_owner(x as u64) == r as u32)
                    .count();
                written += owned as u64 * w.row_bytes();
            }
        }
        begin = end;
    }
    let owners: Vec<u32> = chain.iter().map(|&p| placement.owner(p)).collect();
    out.say(format!(
        "prefill: {} pages, start owner {start}, owners {:?}{}; {} bytes of owned rows written in {:.1} ms",
        chain.len(),
        &owners[..owners.len().min(12)],
        if owners.len() > 12 { " ..." } else { "" },
        written,
        t.elapsed().as_secs_f64() * 1e3
    ));

    // 3: P/D to an unsharded decode pool, against the unsharded reference.
    let t = Instant::now();
    let decode_pages = pages as u64 + 2;
    let reg = Registration {
        request: 1,
        layout: PoolLayout::packed(g.clone(), decode_pages),
        prefix_pages: 0,
        pages: (1..=pages as u64).collect(),
        state_pages: (1..=pages as u64).collect(),
    };
    let decode = DevicePool::allocate(b, &g, Placement::unsharded(), 0, decode_pages)?;
    let expected = DevicePool::allocate(b, &g, Placement::unsharded(), 0, decode_pages)?;
    decode.fill(b, POISON)?;
    expected.fill(b, POISON)?;
    let sent = send_all(b, &ranks, &chain, &decode, &reg, cfg.chunk, cfg.tokens)?;
    send_all(
        b,
        std::slice::from_ref(&reference),
        &ref_chain,
        &expected,
        &reg,
        cfg.chunk,
        cfg.tokens,
    )?;
    let want = expected.snapshot(b)?;
    if decode.snapshot(b)? != want {
        return Err(Error::Transfer {
            request: 1,
            reason: "decode pool differs from what an unsharded prefill sends".into(),
        });
    }
    out.say(format!(
        "P/D: {} ranks sent {} bytes; decode pool byte-identical to the unsharded reference ({:.1} ms)",
        cfg.ranks,
        sent,
        t.elapsed().as_secs_f64() * 1e3
    ));

    // 4: HiCache round trip of every rank's pages, then send again.
    let t = Instant::now();
    let mut host_alloc = ShardAllocator::new(placement, per_rank)?;
    let host_pages = host_alloc.alloc_matching(&chain)?;
    let hosts: Vec<HostPool> = (0..cfg.ranks)
        .map(|_| HostPool::new(b, &g, per_rank, HostLayout::PageFirstDirect))
        .collect::<Result<_>>()?;
    for (r, (pool, host)) in ranks.iter().zip(&hosts).enumerate() {
        let plan = TransferPlan::new(placement, r as u32, &chain, &host_pages, per_rank, per_rank)?;
        hicache_io(
            &mut HostTransfer::new(pool, host, plan, Direction::Backup)?,
            b,
            relayout,
            staged,
        )?;
        pool.fill(b, POISON)?;
    }
    alloc.free(&chain)?;
    let reloaded = alloc.alloc_matching(&chain)?;
    for (r, (pool, host)) in ranks.iter().zip(&hosts).enumerate() {
        let plan = TransferPlan::new(
            placement,
            r as u32,
            &reloaded,
            &host_pages,
            per_rank,
            per_rank,
        )?;
        hicache_io(
            &mut HostTransfer::new(pool, host, plan, Direction::Load)?,
            b,
            relayout,
            staged,
        )?;
    }
    let again = DevicePool::allocate(b, &g, Placement::unsharded(), 0, decode_pages)?;
    again.fill(b, POISON)?;
    send_all(b, &ranks, &reloaded, &again, &reg, cfg.chunk, cfg.tokens)?;
    if again.snapshot(b)? != want {
        return Err(Error::HiCache(
            "after backup, eviction and reload the decode pool differs from the reference".into(),
        ));
    }
    out.say(format!(
        "HiCache: {} pages backed up to pinned host pools ({}), evicted, reloaded into new pages of the same owners; resent decode pool byte-identical ({:.1} ms)",
        chain.len(),
        if staged { "staged copy engine" } else { "copy engine" },
        t.elapsed().as_secs_f64() * 1e3
    ));
    out.say("demo: every check passed".into());
    Ok(out)
}
