//! The seed's accuracy scenario under memory pressure, for one process or many.
//!
//! `kvshard demo --scenario pressure` holds every CP rank in one process ([`run_pressure`]);
//! `kvshard pd --scenario pressure` runs each rank and each decode in a process of its own, and
//! every one of them drives this same scenario (`run_scenario`) with what it holds: its
//! `Local` ranks (all, one, or none for a decode), how their send buffers reach the other
//! ranks (`AllGather`) and what happens to each prefilled chunk and prompt (`Prompts`).
//! Every process keeps the unsharded reference and the group's allocator (both deterministic),
//! so every process makes the same admissions and evictions, and the synthetic KV of a chunk is
//! a function of the seed, the cache node and the chunk's first token, the same everywhere.

//!
//! The scenario, as `run_scenario` runs it:
//! 1. **Set up** (`Scenario::set_up`): the ranks' pools, the unsharded reference, the chunk
//!    staging, the write-through HiCache controllers, the gather's scratch.
//! 2. **Seed** (`seed_prefix`): a prefix prefilled and written through to the host.
//! 3. **Prompt 1** (`prompt_1`): a prompt of its own; the pool makes room by evicting the
//!    prefix; P/D and a backup.
//! 4. **Prompt 2** (`prompt_2`): the seeded prefix, now on the host only, reloaded into new
//!    pages of the same owners and gathered before every chunk; P/D and a backup.
//! 5. **Steady state** (`steady_state`): none of the work above blocked the host.
//! 6. **Storage** (feature `nixl`, `storage.rs`): the prefix to the storage tier and back,
//!    then from the storage tier into a CP group of twice the size (`cross_cp.rs`).

use std::sync::Arc;
use std::time::SystemTime;

use kvshard::backend::Backend;
use kvshard::chain::RequestChain;
use kvshard::geometry::PAGE_SIZE;
use kvshard::hicache::{CacheNode, Route};
use kvshard::pool::DevicePool;
use kvshard::shard::Placement;
use kvshard::transfer::ChunkEnd;
use kvshard::{Error, Result};

use super::{send_checked, SendShape, StreamFactory, Summary};
use crate::measure::{timed_waits, Moved, TimedWaits};
use crate::scenario::PressureConfig;

#[cfg(feature = "nixl")]
mod cross_cp;
mod gather;
mod local;
mod report;
mod scenario;
#[cfg(feature = "nixl")]
pub(crate) mod storage;

pub(crate) use local::{AllGather, Local};
use report::{evicted, PrefillReport};
pub(crate) use scenario::Scenario;

/// The cache node of the seeded prefix.
pub const SEED_NODE: u64 = 1;
/// Prompt 1's cache node, and its P/D request id.
pub const PROMPT_1: u64 = 2;
/// Prompt 2's cache node, and its P/D request id.
pub const PROMPT_2: u64 = 3;

/// What a process does with the prompts (the seed is cached, never sent).
pub(crate) trait Prompts {
    /// The chunk of prompt `request` ending at `end` is written to every local pool (enqueued
    /// on the scenario's stream); `chain` holds the prompt's pages so far.
    fn chunk_written(
        &mut self,
        s: &Scenario,
        request: u64,
        chain: &RequestChain,
        end: ChunkEnd,
    ) -> Result<()>;

    /// Prompt `request` is prefilled, its pages `chain` in the group's pools and `ref_chain` in
    /// the reference; returns what the report says about it.
    fn prompt_done(
        &mut self,
        s: &Scenario,
        request: u64,
        chain: &RequestChain,
        ref_chain: &RequestChain,
    ) -> Result<String>;
}

/// Runs the pressure scenario ([`PressureConfig`]) with every rank in this process on `b`,
/// making further streams of the same device with `streams`, with the HiCache route `route`.
/// Every stage reports its transfers' time measured with events on the device and their GB/s;
/// setup and verification apart.
pub fn run_pressure(
    b: Arc<dyn Backend>,
    streams: StreamFactory<'_>,
    cfg: &PressureConfig,
    route: Route,
) -> Result<Summary> {
    let per_rank = cfg.pages_per_rank()?;
    let g = cfg.shape.geometry();
    let placement = cfg.shape.placement()?;
    let pools = (0..cfg.shape.ranks)
        .map(|r| DevicePool::allocate(b.as_ref(), &g, placement, r, per_rank).map(Arc::new))
        .collect::<Result<_>>()?;
    let local = Local {
        pools,
        all_gather: AllGather::InProcess,
        storage_dir: None,
    };
    let mut prompts = CheckedSend {
        tokens: cfg.prompt_tokens,
        chunk: cfg.chunk,
    };
    Ok(run_scenario(b, streams, cfg, route, local, &mut prompts)?.summary)
}

/// What one process's run of the scenario reports.
#[derive(Debug)]
pub(crate) struct Outcome {
    /// The report's lines.
    pub(crate) summary: Summary,
    /// The prefix's reload from the host, over the local ranks.
    pub(crate) reload: Moved,
    /// When the reload started and ended, on the wall clock.
    pub(crate) reload_window: (SystemTime, SystemTime),
}

/// Runs the scenario in one process holding `local` (module docs), on `b`, making further
/// streams of the same device with `streams`, with the HiCache route `route`; `prompts` sees
/// every prompt chunk and prompt prefilled.
pub(crate) fn run_scenario(
    b: Arc<dyn Backend>,
    streams: StreamFactory<'_>,
    cfg: &PressureConfig,
    route: Route,
    local: Local,
    prompts: &mut dyn Prompts,
) -> Result<Outcome> {
    let mut out = Summary::default();
    let waits = timed_waits();
    #[cfg(feature = "nixl")]
    let storage_dir = local.storage_dir.clone();
    let mut s = Scenario::set_up(b, streams, cfg, route, local, &mut out)?;
    let seed = seed_prefix(&mut s, cfg, &mut out)?;
    prompt_1(&mut s, cfg, prompts, &mut out)?;
    let (reload, reload_window) = prompt_2(&mut s, cfg, &seed, prompts, &mut out)?;
    steady_state(waits, &mut out)?;
    #[cfg(feature = "nixl")]
    storage(&mut s, cfg, &seed, storage_dir.as_deref(), &mut out)?;
    #[cfg(not(feature = "nixl"))]
    out.say("storage: SKIPPED, built without the `nixl` feature (the storage tier runs on NIXL's POSIX backend)".into());
    out.say("pressure scenario: every check passed".into());
    Ok(Outcome {
        summary: out,
        reload,
        reload_window,
    })
}

/// The seeded prefix: its pages in the group's pools and in the reference, and its cache node.
struct Seeded {
    chain: RequestChain,
    reference: RequestChain,
    node: CacheNode,
}

/// The seeded prefix, written through to the host, its backup awaited.
fn seed_prefix(s: &mut Scenario, cfg: &PressureConfig, out: &mut Summary) -> Result<Seeded> {
    let mut seed = RequestChain::new(s.placement);
    let mut seed_ref = RequestChain::new(Placement::unsharded());
    let r = s.prefill(
        SEED_NODE,
        None,
        &mut seed,
        &mut seed_ref,
        0,
        cfg.prefix_tokens,
        false,
    )?;
    let seed_node = CacheNode::of_chain(&seed, SEED_NODE, 0..seed.page_count())?;
    let backup = s.backup(&seed_node)?;
    s.evictable.push_back(seed_node.clone());
    out.say(format!(
        "seed: {} tokens in {} chunks, owned-row writes {}; written through to the host, backup awaited: {backup} (setup {:.1} ms)",
        cfg.prefix_tokens, r.chunks, r.writes, r.setup_ms
    ));
    Ok(Seeded {
        chain: seed,
        reference: seed_ref,
        node: seed_node,
    })
}

/// Prompt 1: a prompt of its own; the pool makes room by evicting the prefix (no eviction is an
/// error: there was no pressure). `prompts` sends it; its backup is awaited.
fn prompt_1(
    s: &mut Scenario,
    cfg: &PressureConfig,
    prompts: &mut dyn Prompts,
    out: &mut Summary,
) -> Result<()> {
    let mut p1 = RequestChain::new(s.placement);
    let mut p1_ref = RequestChain::new(Placement::unsharded());
    let r = s.prefill(
        PROMPT_1,
        Some(&mut *prompts),
        &mut p1,
        &mut p1_ref,
        0,
        cfg.prompt_tokens,
        false,
    )?;
    if r.evicted.is_empty() {
        return Err(Error::Verification(
            "prompt 1 evicted nothing: there was no pressure".into(),
        ));
    }
    let sent = prompts.prompt_done(s, PROMPT_1, &p1, &p1_ref)?;
    let p1_node = CacheNode::of_chain(&p1, PROMPT_1, 0..p1.page_count())?;
    let backup = s.backup(&p1_node)?;
    s.evictable.push_back(p1_node);
    out.say(format!(
        "prompt 1: {} tokens in {} chunks, {}; owned-row writes {}; {sent}; backup {backup} (setup {:.1} ms)",
        cfg.prompt_tokens,
        r.chunks,
        evicted(&r),
        r.writes,
        r.setup_ms
    ));
    Ok(())
}

/// Prompt 2: the seeded prefix, now on the host only, then new tokens. Reloading the prefix
/// needs room: prompt 1 goes. Every chunk first gathers its prefix. Returns the reload from the
/// host and its window on the wall clock.
fn prompt_2(
    s: &mut Scenario,
    cfg: &PressureConfig,
    seed: &Seeded,
    prompts: &mut dyn Prompts,
    out: &mut Summary,
) -> Result<(Moved, (SystemTime, SystemTime))> {
    let local_ranks = !s.ranks.is_empty();
    let mut room = PrefillReport::default();
    let stride = u64::from(cfg.shape.ranks) * PAGE_SIZE as u64;
    s.make_room(cfg.prefix_tokens as u64 + stride, &mut room)?;
    let pages = s.alloc.alloc_matching(&seed.node.device_pages)?;
    let reload_start = SystemTime::now();
    let load = s.load(seed.node.id, &pages)?;
    let reload_window = (reload_start, SystemTime::now());
    if local_ranks && load.bytes == 0 {
        return Err(Error::Verification(
            "the prefix was not reloaded from the host: H2D did not grow".into(),
        ));
    }
    let start_owner = seed.chain.start_owner().unwrap_or(0);
    let mut p2 = RequestChain::cached(&s.alloc, start_owner, pages.clone())?;
    let mut p2_ref = RequestChain::cached(&s.ref_alloc, 0, seed.reference.pages()?.to_vec())?;
    let r = s.prefill(
        PROMPT_2,
        Some(&mut *prompts),
        &mut p2,
        &mut p2_ref,
        cfg.prefix_tokens,
        cfg.prompt_tokens,
        true,
    )?;
    let sent = prompts.prompt_done(s, PROMPT_2, &p2, &p2_ref)?;
    let p2_node = CacheNode::of_chain(&p2, PROMPT_2, seed.chain.page_count()..p2.page_count())?;
    let backup = s.backup(&p2_node)?;
    s.evictable.push_back(CacheNode {
        device_pages: pages,
        ..seed.node.clone()
    });
    s.evictable.push_back(p2_node);
    out.say(format!(
        "prompt 2: the seeded prefix matched on the host only; making room {}; reloaded H2D into new pages of the same owners: {load}",
        evicted(&room)
    ));
    out.say(format!(
        "prompt 2: H2D grew from 0 to {} bytes; {} new tokens in {} chunks, owned-row writes {}",
        load.bytes,
        cfg.prompt_tokens - cfg.prefix_tokens,
        r.chunks,
        r.writes
    ));
    if s.gather.is_some() {
        out.say(gathered(s, &r));
    }
    out.say(format!(
        "prompt 2: {sent}; backup of its new pages {backup}"
    ));
    Ok((load, reload_window))
}

/// What the report says of prompt 2's gathers (`r` its prefill).
fn gathered(s: &Scenario, r: &PrefillReport) -> String {
    let layers = s.g.model_layers();
    let exchange = if r.exchange_ms > 0.0 {
        format!(" (host exchange {:.1} ms wall)", r.exchange_ms)
    } else {
        String::new()
    };
    format!(
        "prompt 2: before each of {} chunks its prefix was gathered ({layers} layers): the local ranks packed their send lists ({} bytes) and {} landed every rank's block in the local scratch, owner-major ({} bytes): {}{exchange}, {:.3} ms per layer; page tables built by kvs_scratch_table in {:.2} ms; every local scratch read through the page table equals the reference's prefix pages (verified in {:.1} ms; setup {:.1} ms)",
        r.gathers,
        r.packed,
        s.all_gather.describe(),
        r.gathered,
        r.gather,
        r.gather.ms / (r.gathers.max(1) * layers.max(1)) as f64,
        r.table_ms,
        r.verify_ms,
        r.setup_ms
    )
}

/// The steady state an engine lives in: every write, gather, send, backup and load since
/// `waits` was enqueued inside a timed stretch, and none of those calls may block the host.
fn steady_state(waits: TimedWaits, out: &mut Summary) -> Result<()> {
    let waits = timed_waits() - waits;
    if waits.waits != 0 {
        return Err(Error::Verification(format!(
            "{} host waits while enqueueing {} stretches of steady-state work (writes, gathers, sends, backups, loads): only _sync calls may wait",
            waits.waits, waits.stretches
        )));
    }
    out.say(format!(
        "steady state: {} stretches of writes, gathers, sends, backups and loads enqueued with 0 host waits (only the _sync calls around them waited)",
        waits.stretches
    ));
    Ok(())
}

/// The storage tier below the host pools (feature `nixl`), on every process holding ranks
/// (every rank here, or one rank per process sharing the directory `shared`).
#[cfg(feature = "nixl")]
fn storage(
    s: &mut Scenario,
    cfg: &PressureConfig,
    seed: &Seeded,
    shared: Option<&std::path::Path>,
    out: &mut Summary,
) -> Result<()> {
    if s.ranks.is_empty() {
        out.say("storage: not run here: a decode holds no CP rank".into());
        return Ok(());
    }
    for line in s.storage_step(&seed.node, &seed.reference, cfg.prefix_tokens, shared)? {
        out.say(line);
    }
    Ok(())
}

/// The demo's P/D, in one process: once a prompt is prefilled every rank sends it whole into a
/// decode pool, the reference into another, and the two must be byte-identical.
struct CheckedSend {
    tokens: usize,
    chunk: usize,
}

impl Prompts for CheckedSend {
    fn chunk_written(&mut self, _: &Scenario, _: u64, _: &RequestChain, _: ChunkEnd) -> Result<()> {
        Ok(())
    }

    fn prompt_done(
        &mut self,
        s: &Scenario,
        _: u64,
        chain: &RequestChain,
        ref_chain: &RequestChain,
    ) -> Result<String> {
        let shape = SendShape {
            geometry: &s.g,
            tokens: self.tokens,
            chunk: self.chunk,
        };
        let ranks = (s.ranks.as_slice(), chain);
        let (sent, _, check_ms) = send_checked(&s.b, ranks, (&s.reference, ref_chain), &shape)?;
        Ok(format!(
            "P/D sent {sent}, decode pool byte-identical to the unsharded reference (verified in {check_ms:.1} ms)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvshard::backend::cpu::CpuBackend;
    use kvshard::ipc::group::GroupMemory;

    use crate::scenario::Platform;

    struct Nothing;

    impl Prompts for Nothing {
        fn chunk_written(
            &mut self,
            _: &Scenario,
            _: u64,
            _: &RequestChain,
            _: ChunkEnd,
        ) -> Result<()> {
            Ok(())
        }

        fn prompt_done(
            &mut self,
            _: &Scenario,
            _: u64,
            _: &RequestChain,
            _: &RequestChain,
        ) -> Result<String> {
            Ok(String::new())
        }
    }

    /// Runs the scenario holding `local` on a fresh CPU backend.
    fn run_holding(
        cfg: &PressureConfig,
        local: impl FnOnce(&Arc<dyn Backend>) -> Local,
    ) -> Result<Outcome> {
        let cpu = CpuBackend::new();
        let b: Arc<dyn Backend> = Arc::new(cpu.new_stream());
        let streams = || -> Result<Arc<dyn Backend>> { Ok(Arc::new(cpu.new_stream())) };
        let local = local(&b);
        run_scenario(b, &streams, cfg, Platform::Cpu.route(), local, &mut Nothing)
    }

    fn pool(b: &Arc<dyn Backend>, cfg: &PressureConfig, rank: u32, pages: u64) -> Arc<DevicePool> {
        let placement = cfg.shape.placement().unwrap();
        let g = cfg.shape.geometry();
        Arc::new(DevicePool::allocate(b.as_ref(), &g, placement, rank, pages).unwrap())
    }

    #[test]
    fn a_process_holding_what_the_scenario_cannot_use_is_refused_before_it_runs() {
        let cfg = PressureConfig::default_for(Platform::Cpu);
        let per_rank = cfg.pages_per_rank().unwrap();
        let refused = |e: Result<Outcome>| {
            assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
        };
        // In one process the landings read every rank's send buffer: every rank must be there.
        refused(run_holding(&cfg, |b| Local {
            pools: vec![pool(b, &cfg, 0, per_rank)],
            all_gather: AllGather::InProcess,
            storage_dir: None,
        }));
        // A pool of another size, or a rank twice.
        refused(run_holding(&cfg, |b| Local {
            pools: vec![pool(b, &cfg, 0, per_rank + 1), pool(b, &cfg, 1, per_rank)],
            all_gather: AllGather::InProcess,
            storage_dir: None,
        }));
        refused(run_holding(&cfg, |b| Local {
            pools: vec![pool(b, &cfg, 0, per_rank), pool(b, &cfg, 0, per_rank)],
            all_gather: AllGather::InProcess,
            storage_dir: None,
        }));
        // A host-staged group where this process is another rank, or whose slots are short.
        let slot = cfg.send_bytes().unwrap();
        for (rank, slot_bytes) in [(1, slot), (0, slot - 1)] {
            let shm = GroupMemory::create(cfg.shape.ranks, slot_bytes).unwrap();
            let group = GroupMemory::join(
                &shm.proc_path(),
                rank,
                cfg.shape.ranks,
                slot_bytes,
                std::time::Duration::from_millis(100),
            )
            .unwrap();
            refused(run_holding(&cfg, |b| Local {
                pools: vec![pool(b, &cfg, 0, per_rank)],
                all_gather: AllGather::HostStaged(group),
                storage_dir: None,
            }));
        }
    }

    #[test]
    fn a_decode_holding_no_rank_replays_the_reference_alone() {
        let cfg = PressureConfig::default_for(Platform::Cpu);
        let outcome = run_holding(&cfg, |_| Local {
            pools: Vec::new(),
            all_gather: AllGather::InProcess,
            storage_dir: None,
        })
        .unwrap();
        assert_eq!(outcome.reload.bytes, 0);
        assert_eq!(
            outcome.summary.lines.last().map(String::as_str),
            Some("pressure scenario: every check passed")
        );
    }
}
