//! A decode of the pressure run: its pool, its registrations, its replay of the scenario and
//! the check of every block that landed.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use kvshard::backend::{Backend, MemoryKind};
use kvshard::chain::RequestChain;
use kvshard::copy::BlockSpace;
use kvshard::ipc::{ExportedPool, Liveness, PeerBackend};
use kvshard::pool::DevicePool;
use kvshard::shard::{Placement, ShardAllocator};
use kvshard::transfer::{ChunkEnd, DecodeEndpoint, Finished, PoolLayout, Registration};
use kvshard::{Error, Result};

use super::super::message::Message;
use super::super::{ceiling, layer_range, rank0_gpu, verify_landed, DecodeWatch, Role, STARTUP};
use super::dcp::GroupRank;
use super::{decode_socket, platform, streams_of, PressurePdConfig};
use crate::demo::pressure::{
    run_scenario, AllGather, Local, Prompts, Scenario, PROMPT_1, PROMPT_2,
};
use crate::measure::{copy_sync, Ceiling, Timer};
use crate::synth::POISON;

/// What a decode keeps of its replay of the scenario: the reference and its prompts' chains.
#[derive(Default)]
struct Replay {
    /// The reference's chain of each prompt.
    refs: HashMap<u64, RequestChain>,
    /// The reference pool, once a prompt is prefilled.
    reference: Option<Arc<DevicePool>>,
}

impl Prompts for Replay {
    fn chunk_written(&mut self, _: &Scenario, _: u64, _: &RequestChain, _: ChunkEnd) -> Result<()> {
        Ok(())
    }

    fn prompt_done(
        &mut self,
        s: &Scenario,
        request: u64,
        _: &RequestChain,
        ref_chain: &RequestChain,
    ) -> Result<String> {
        self.reference = Some(s.reference().clone());
        self.refs.insert(request, ref_chain.clone());
        Ok("the reference replayed".into())
    }
}

/// Decode process `index`: publishes its pool to every rank, registers both prompts (whole, or
/// as rank `index % M` of DCP group `index / M` its share, rank 0 of the group also handing the
/// group's registration to every rank), waits for both (polling only, so each is timed when it
/// finishes), then replays the reference and checks every block (or row) that landed against
/// it. Decode process 0 also measures the copy ceilings first.
pub fn decode_role(cfg: &PressurePdConfig, socket: &Path, index: u32) -> Result<()> {
    cfg.validate()?;
    let mut side = open(cfg, socket, index)?;
    // An unsharded decode registers each prompt whole; a decode rank of a DCP group its share.
    let group = if cfg.is_dcp() {
        Some(GroupRank::register(
            cfg,
            socket,
            index,
            &mut side.endpoint,
            side.pool_id,
            &side.pool,
        )?)
    } else {
        register_whole(cfg, &mut side)?;
        None
    };
    let b = side.backend.backend();
    let pool = side.pool.clone();
    let mut watch = DecodeWatch::new(side.endpoint);
    let landed = [watch.wait_sync(PROMPT_1)?, watch.wait_sync(PROMPT_2)?];
    let (replay, reference) = replay_reference(cfg, &side.backend)?;
    for (prompt, (request, (finished, done))) in
        [PROMPT_1, PROMPT_2].into_iter().zip(landed).enumerate()
    {
        if !finished.is_completed() {
            return Err(Error::Transfer {
                request,
                reason: format!("failed: {:?}", finished.outcome),
            });
        }
        let ref_chain = replay.refs.get(&request).ok_or_else(|| {
            Error::Verification(format!("no reference chain of request {request}"))
        })?;
        let check = Instant::now();
        let what = match &group {
            None => {
                verify_against(b.as_ref(), &pool, &reference, ref_chain, &finished)?;
                "block for block".to_string()
            }
            Some(g) => {
                let rows = g.verify_sync(b.as_ref(), &pool, &reference, ref_chain, prompt)?;
                format!("re-laid out for {g}, {rows} rows")
            }
        };
        println!(
            "request {request} landed equal to the reference, {what} (checked in {:.1} ms)",
            check.elapsed().as_secs_f64() * 1e3
        );
        Message::Landed {
            request,
            bytes: finished.total_bytes().total(),
            done,
        }
        .emit();
    }
    Ok(())
}

/// A decode process with its pool published to every rank.
struct DecodeSide {
    backend: PeerBackend,
    pool: Arc<DevicePool>,
    endpoint: DecodeEndpoint,
    pool_id: u64,
}

/// Decode process `index`: measures the ceilings (the first), allocates and poisons its pool,
/// waits for every rank and publishes the pool to them.
fn open(cfg: &PressurePdConfig, socket: &Path, index: u32) -> Result<DecodeSide> {
    let sc = &cfg.scenario;
    let (p, ranks) = (&cfg.processes, sc.shape.ranks);
    let backend = p.open_backend(ranks, Role::Decode(index))?;
    let b = backend.backend();
    if index == 0 {
        Message::Ceiling(ceiling(&backend, rank0_gpu(p, ranks)?)?).emit();
        Message::H2dCeiling(h2d_ceiling(&backend)?).emit();
    }
    let g = sc.shape.geometry();
    let exported = Arc::new(ExportedPool::allocate(
        &backend,
        &g,
        Placement::unsharded(),
        0,
        cfg.decode_pages(),
    )?);
    let pool = exported.pool().clone();
    pool.fill(b.as_ref(), POISON)?;
    b.synchronize()?;
    let mut endpoint = DecodeEndpoint::bind(
        decode_socket(socket, index),
        backend.clone(),
        ranks,
        Liveness::default(),
    )?;
    endpoint.set_deadline(p.deadline);
    endpoint.wait_for_ranks_sync(STARTUP)?;
    let pool_id = endpoint.publish(exported)?;
    Ok(DecodeSide {
        backend,
        pool,
        endpoint,
        pool_id,
    })
}

/// Registers both prompts whole with every rank, each after a poisoned guard page.
fn register_whole(cfg: &PressurePdConfig, side: &mut DecodeSide) -> Result<()> {
    let unsharded = Placement::unsharded();
    let mut alloc = ShardAllocator::new(unsharded, side.pool.pages())?;
    for request in [PROMPT_1, PROMPT_2] {
        // The guard page before the request stays poisoned.
        RequestChain::new(unsharded).grow_to(&mut alloc, 1)?;
        let mut chain = RequestChain::new(unsharded);
        chain.grow_to(&mut alloc, cfg.scenario.prompt_tokens)?;
        side.endpoint.register(
            side.pool_id,
            Registration::of_chain(&chain, request, PoolLayout::of(&side.pool), 0)?,
        )?;
    }
    Ok(())
}

/// Replays the scenario's unsharded reference prefill here: the reference pool and the chain of
/// each prompt in it.
fn replay_reference(
    cfg: &PressurePdConfig,
    backend: &PeerBackend,
) -> Result<(Replay, Arc<DevicePool>)> {
    let mut replay = Replay::default();
    let local = Local {
        pools: Vec::new(),
        all_gather: AllGather::InProcess,
        storage_dir: None,
    };
    let route = platform(backend).route();
    run_scenario(
        backend.backend(),
        &streams_of(backend),
        &cfg.scenario,
        route,
        local,
        &mut replay,
    )?;
    let reference = replay
        .reference
        .clone()
        .ok_or_else(|| Error::Verification("the scenario ended without its reference".into()))?;
    Ok((replay, reference))
}

/// The pinned host-to-device ceiling the reloads are measured against: one copy-engine copy of
/// 1 GiB (32 MiB on the CPU twin, indicative only) from pinned host memory, best of four.
fn h2d_ceiling(backend: &PeerBackend) -> Result<Ceiling> {
    let hardware = platform(backend).is_gpu();
    let len: usize = if hardware { 1 << 30 } else { 32 << 20 };
    let b = backend.backend();
    let t = copy_sync(
        &Timer::new(b.as_ref()),
        MemoryKind::PinnedHost,
        MemoryKind::Device,
        len,
        4,
    )?;
    Ok(Ceiling {
        what: format!("pinned H2D, one copy-engine copy of {} MiB", len >> 20),
        gbps: t.best_gbps(),
        hardware,
    })
}

/// Checks decode pool `pool` after `finished` landed: each block equals the reference's block
/// of the same sequence position (read a stored layer at a time).
fn verify_against(
    b: &dyn Backend,
    pool: &DevicePool,
    reference: &DevicePool,
    ref_chain: &RequestChain,
    finished: &Finished,
) -> Result<()> {
    let storage = reference
        .storage()
        .ok_or_else(|| Error::InvalidArgument("the reference is allocated by kvshard".into()))?;
    let mut layer: Option<((usize, usize), Vec<u8>)> = None;
    verify_landed(b, pool, &finished.registration, &mut |c, l, position| {
        if layer.as_ref().map(|(key, _)| *key) != Some((c, l)) {
            let (offset, len) = layer_range(reference, c, l)?;
            layer = Some(((c, l), b.read_sync(storage, offset, len)?));
        }
        let bytes = layer
            .as_ref()
            .map(|(_, bytes)| bytes.as_slice())
            .unwrap_or(&[]);
        let block = reference.components()[c].block_bytes;
        let page = ref_chain
            .pages()?
            .get(position)
            .ok_or_else(|| Error::Verification(format!("position {position} past the chain")))?;
        let at = page.0 as usize * block;
        bytes
            .get(at..at + block)
            .map(<[u8]>::to_vec)
            .ok_or_else(|| Error::Verification(format!("{page} past the reference")))
    })
}
