//! A prefill rank sending into a decode server sharded by token over NIXL (decode context
//! parallelism, docs/dcp.md, "Over NIXL"): [`NixlDecodeTransport`] keeps one connection per
//! decode rank (each decode rank is a [`NixlTarget`](super::NixlTarget) of its own, with its
//! own bounce slots), packs every decode rank's rows of a chunk densely into a free slot of
//! that rank's connection with one `kvs_decode_scatter` launch ([`DenseBounce`]), and posts
//! each region as one descriptor with the rank's status and what it needs to unpack riding on
//! it ([`Dense`]): one descriptor per (chunk, prefill rank, decode rank). A decode rank the
//! chunk moves no row to gets its status alone. The decode rank unpacks the region into its
//! pages with the same kernel before it hands the status to its receiver.
//!
//! A decode rank's rows are not runs of whole blocks on either side, so there is no coalesced
//! route: a chunk finding no free slot at a decode rank it moves rows to, or whose rows there
//! do not fit a slot, is refused before anything moves (an engine waits for slots with
//! [`NixlDecodeTransport::wait_for_slots_sync`], and sizes the decode ranks' slots for its
//! chunks: [`region_of`] gives a rank's bytes).

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::initiator::NixlCompletion;
use super::notice::{component_code, Dense};
use super::registration::NixlBackend;
use super::{NixlConfig, NixlMode, NixlTransport};
use crate::backend::Buffer;
use crate::copy::{BlockSpace, RemoteSpace};
use crate::error::{Error, Result};
use crate::ipc::wire::NixlPeer;
use crate::lock::lock;
use crate::pool::DevicePool;
use crate::shard::MAX_DECODE_RANKS;
use crate::transfer::decode_bounce::{region_of, DenseBounce, DenseChunk};
use crate::transfer::plan::{DecodePlan, SendPlan};
use crate::transfer::stats::TransferStats;
use crate::transfer::transport::{Completion, Transport};
use crate::transfer::{ChunkResult, ChunkStatus};

/// A [`Transport`] on NIXL for one prefill rank into the M ranks of a decode context-parallel
/// server (module docs): [`Transport::submit_decode`] only. Clones share the connections, so an
/// engine boxes one into its [`Sender`](crate::transfer::Sender) and keeps another to connect,
/// report failures and read the stats.
#[derive(Clone)]
pub struct NixlDecodeTransport {
    members: Vec<NixlTransport>,
    pool: Arc<DevicePool>,
    bounce: Arc<Mutex<DenseBounce>>,
    stats: TransferStats,
}

impl fmt::Debug for NixlDecodeTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlDecodeTransport")
            .field("decode_ranks", &self.members.len())
            .finish_non_exhaustive()
    }
}

impl NixlDecodeTransport {
    /// Creates one agent per decode rank (named `{config.agent}-d{rank}`), each registering
    /// `pool` (memory of `device`'s backend). The mode must let chunks bounce
    /// ([`NixlMode::Auto`] or [`NixlMode::Bounce`]: every chunk bounces here).
    ///
    /// A missing NIXL library is [`Error::NixlUnavailable`], saying what to install.
    pub fn new(
        device: NixlBackend,
        pool: Arc<DevicePool>,
        config: NixlConfig,
        decode_ranks: u32,
    ) -> Result<Self> {
        if decode_ranks == 0 || decode_ranks > MAX_DECODE_RANKS {
            return Err(Error::out_of_bounds(
                "decode ranks of a NIXL decode group",
                decode_ranks.to_string(),
                format!("1 to {MAX_DECODE_RANKS}"),
            ));
        }
        if matches!(config.mode, NixlMode::Coalesced | NixlMode::PerBlock) {
            return Err(Error::InvalidArgument(format!(
                "a NIXL decode group in mode {:?}: a decode context-parallel chunk travels only through bounce slots (Auto or Bounce)",
                config.mode
            )));
        }
        let stats = TransferStats::new("nixl");
        let bounce = Arc::new(Mutex::new(DenseBounce::new(device.backend())));
        let members = (0..decode_ranks)
            .map(|d| {
                let config = NixlConfig {
                    agent: format!("{}-d{d}", config.agent),
                    ..config.clone()
                };
                NixlTransport::counting_into(device.clone(), pool.clone(), config, stats.clone())
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            members,
            pool,
            bounce,
            stats,
        })
    }

    fn member(&self, decode_rank: u32) -> Result<&NixlTransport> {
        self.members
            .get(decode_rank as usize)
            .ok_or(Error::OutOfRange {
                what: "decode rank",
                index: i64::from(decode_rank),
                limit: self.members.len() as u64,
            })
    }

    /// What to send decode rank `decode_rank`: the agent of its connection and the geometry.
    pub fn peer_info(&self, decode_rank: u32) -> Result<NixlPeer> {
        self.member(decode_rank)?.peer_info()
    }

    /// Connects to decode rank `decode_rank`, which `peer` describes
    /// ([`NixlTransport::connect`]); the rank must keep bounce slots for this prefill rank.
    /// Returns its destination, in rank order what
    /// [`Sender::open_decode`](crate::transfer::Sender::open_decode) takes.
    pub fn connect(&self, decode_rank: u32, peer: &NixlPeer) -> Result<Arc<RemoteSpace>> {
        let member = self.member(decode_rank)?;
        if peer.slot_pages == 0 || peer.slots.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "decode rank {decode_rank} keeps no bounce slots for this prefill rank: a decode context-parallel chunk travels only through them (NixlConfig::slots and slot_pages on the decode side)"
            )));
        }
        member.connect(peer)
    }

    /// Decode rank `decode_rank` is gone (its control channel said so): its chunks still
    /// moving fail ([`NixlTransport::peer_gone`]); so does every later chunk reaching it.
    pub fn peer_gone(&self, decode_rank: u32, why: &str) -> Result<()> {
        self.member(decode_rank)?.peer_gone(why);
        Ok(())
    }

    /// Tells every decode rank a status the [`Sender`](crate::transfer::Sender) produced
    /// without this transport (a chunk whose plan was refused, an abort); the first failure
    /// to tell one is returned, after trying them all.
    pub fn report(&self, status: &ChunkStatus) -> Result<()> {
        let mut first = Ok(());
        for m in &self.members {
            let r = m.report(status);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// This transport's counters: every decode rank's connection counts into them, so a chunk
    /// counts once per decode rank it reports to (its descriptors: one per decode rank it moves
    /// rows to).
    pub fn transfer_stats(&self) -> TransferStats {
        self.stats.clone()
    }

    /// Blocks the host up to `timeout` until every bounce slot of every decode rank's
    /// connection is free on both sides; whether they are.
    pub fn wait_for_slots_sync(&self, timeout: Duration) -> bool {
        let deadline = Instant::now().checked_add(timeout);
        self.members.iter().all(|m| {
            let left = deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            });
            m.wait_for_slots_sync(left)
        })
    }

    /// Checks every decode rank's connection and takes a slot at each the chunk moves rows to,
    /// in rank order into `regions` (its memory) and `parts` (what the rank needs to unpack,
    /// its bytes, the slot); stops at the first refusal, the slots taken so far in `parts`.
    fn take_slots(
        &self,
        plan: &DecodePlan,
        src: &Arc<DevicePool>,
        dsts: &[Arc<RemoteSpace>],
        regions: &mut Vec<Option<Buffer>>,
        parts: &mut Vec<(DenseChunk, u64, Option<usize>)>,
    ) -> Result<()> {
        let request = plan.request();
        let components = src.geometry().components();
        for (d, (member, dst)) in (0u32..).zip(self.members.iter().zip(dsts)) {
            let mut s = lock(&member.state);
            s.check_peer(request, dst)?;
            let (dense, bytes) = region_of(plan, &components, d)?;
            if dense.is_empty() {
                regions.push(None);
                parts.push((dense, bytes, None));
                continue;
            }
            let (slot, memory) = s.take_slot().ok_or_else(|| Error::Transfer {
                request,
                reason: format!(
                    "no bounce slot free at decode rank {d}: a decode context-parallel chunk has no other route over NIXL (wait_for_slots_sync first)"
                ),
            })?;
            let fits = bytes <= memory.len() as u64;
            let len = memory.len();
            regions.push(Some(memory));
            parts.push((dense, bytes, Some(slot)));
            if !fits {
                return Err(Error::Transfer {
                    request,
                    reason: format!(
                        "decode rank {d}'s rows of the chunk take {bytes} B, more than a bounce slot's {len} B (more slot pages on the decode ranks, or smaller chunks)"
                    ),
                });
            }
        }
        Ok(())
    }

    /// Packs and posts `plan` (module docs); refused before anything moves when a decode rank
    /// it moves rows to has no free slot or its rows do not fit one.
    fn post(
        &self,
        plan: &DecodePlan,
        src: &Arc<DevicePool>,
        dsts: &[Arc<RemoteSpace>],
        started: Instant,
    ) -> Result<Box<dyn Completion>> {
        let request = plan.request();
        let layout = plan.layout();
        let m = layout.ranks() as usize;
        if dsts.len() != m || self.members.len() != m {
            return Err(Error::Transfer {
                request,
                reason: format!(
                    "a chunk for {m} decode ranks through a NIXL decode group of {} into {} destinations",
                    self.members.len(),
                    dsts.len()
                ),
            });
        }
        if src.id() != self.pool.id() {
            return Err(Error::InvalidArgument(
                "a NIXL decode group moves from the pool it registered".into(),
            ));
        }
        let mut regions = Vec::with_capacity(m);
        let mut parts = Vec::with_capacity(m);
        // Slots are taken as they are found (a clone may submit meanwhile) and given back when
        // the chunk is refused before it is posted.
        let taken = self.take_slots(plan, src, dsts, &mut regions, &mut parts);
        let packed = taken.and_then(|()| lock(&self.bounce).pack(plan, src, &regions));
        let event = match packed {
            Ok(p) => p.event,
            Err(e) => {
                for (member, (_, _, slot)) in self.members.iter().zip(&parts) {
                    lock(&member.state).release_slot(*slot, true);
                }
                return Err(e);
            }
        };
        let chunk = plan.chunk();
        let mut completions: Vec<Box<dyn Completion>> = Vec::with_capacity(m);
        for (d, (dense, bytes, slot)) in (0u32..).zip(parts.iter()) {
            let member = &self.members[d as usize];
            let status = ChunkStatus {
                request,
                rank: plan.rank(),
                chunk: chunk.index,
                result: ChunkResult::Sent {
                    bytes: plan
                        .rank_bytes()
                        .get(d as usize)
                        .copied()
                        .unwrap_or_default(),
                    last: chunk.last,
                },
            };
            let inflight = {
                let mut s = lock(&member.state);
                match slot {
                    None => s.announce(status, started),
                    Some(slot) => {
                        let wire = Dense {
                            slot: *slot as u32,
                            ranks: layout.ranks(),
                            interleave: layout.interleave(),
                            rank: d,
                            end_token: dense.end_token,
                            sections: dense
                                .sections
                                .iter()
                                .map(|s| {
                                    let codes = s.components.iter().map(|&c| component_code(c));
                                    (codes.collect(), s.positions.clone())
                                })
                                .collect(),
                        };
                        s.submit_dense(status, wire, *bytes, event.clone(), started)
                    }
                }
            };
            match inflight {
                Ok(chunk) => completions.push(Box::new(NixlCompletion::new(member, chunk))),
                Err(e) => {
                    // This rank's part released its own slot; the later ranks' slots go back
                    // unused. The parts posted so far are dropped with `completions`, each
                    // failing at its decode rank; the engine reports the failure to every
                    // decode rank (`report`), as for any failed chunk.
                    for (member, (_, _, slot)) in
                        self.members.iter().zip(&parts).skip(d as usize + 1)
                    {
                        lock(&member.state).release_slot(*slot, true);
                    }
                    return Err(e);
                }
            }
        }
        Ok(Box::new(GroupCompletion { parts: completions }))
    }
}

/// The completion of a chunk into every decode rank: landed when each rank's part has.
struct GroupCompletion {
    parts: Vec<Box<dyn Completion>>,
}

impl Completion for GroupCompletion {
    fn poll(&mut self) -> Result<bool> {
        let mut all = true;
        for p in &mut self.parts {
            all &= p.poll()?;
        }
        Ok(all)
    }

    fn wait_sync(&mut self) -> Result<()> {
        // Each part is bounded by the transfer timeout.
        for p in &mut self.parts {
            p.wait_sync()?;
        }
        Ok(())
    }

    fn transfer_time(&self) -> Option<Duration> {
        let times: Option<Vec<Duration>> = self.parts.iter().map(|p| p.transfer_time()).collect();
        times.and_then(|t| t.into_iter().max())
    }
}

impl Transport for NixlDecodeTransport {
    /// Refused: a decode group sends into decode context-parallel layouts only (an unsharded
    /// decode takes a [`NixlTransport`]).
    fn submit(
        &mut self,
        plan: &SendPlan,
        _src: &Arc<DevicePool>,
        _dst: &Arc<RemoteSpace>,
    ) -> Result<Box<dyn Completion>> {
        Err(Error::Transfer {
            request: plan.request(),
            reason: "a NIXL decode group sends only into a decode context-parallel layout (Sender::open_decode); an unsharded decode takes a NixlTransport".into(),
        })
    }

    fn submit_decode(
        &mut self,
        plan: &DecodePlan,
        src: &Arc<DevicePool>,
        dsts: &[Arc<RemoteSpace>],
    ) -> Result<Box<dyn Completion>> {
        let started = Instant::now();
        let result = self.post(plan, src, dsts, started);
        // Each decode rank's posting was counted where it was posted.
        self.stats.submitted(started, result, || None)
    }

    fn stats(&self) -> Option<TransferStats> {
        Some(self.stats.clone())
    }
}
