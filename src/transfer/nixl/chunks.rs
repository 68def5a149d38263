//! One chunk's way through a prefill rank's NIXL connection: the choice between a bounce slot
//! and coalesced descriptors, the packing into a slot, the transfer request posted with the
//! chunk's notice, its progress up to the bytes landing, and its failure (a failure notice to
//! the decode side, a request NIXL may still move kept until it is done).

use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl_sys::XferRequest;

use super::agent::{Agent, Progress};
use super::connection::State;
use super::notice::{component_code, Bounced, Dense, Notice};
use super::registration::{component_index, BounceSpace};
use super::NixlMode;
use crate::backend::{Event, KernelFamily, Launch};
use crate::copy::{BlockCopyPlan, BlockSpace, PageSelection, RemoteSpace};
use crate::error::{Error, Result};
use crate::pool::DevicePool;
use crate::transfer::plan::{Section, SendPlan};
use crate::transfer::stats::Posted;
use crate::transfer::{ChunkResult, ChunkStatus};

/// Where one chunk stands.
pub(super) enum Stage {
    /// Waiting for its bounce packing to finish before it is posted.
    Packing {
        event: Event,
        li: Vec<i32>,
        ri: Vec<i32>,
    },
    /// Posted.
    Moving {
        request: XferRequest,
        posted: Instant,
    },
    /// A chunk that moved no bytes: its notice went alone; done once the decode says it took
    /// it ([`Notice::Taken`]).
    Announced,
    /// Landed.
    Done,
    /// Failed (the failure notice has been sent).
    Failed(String),
}

/// A submitted chunk.
pub(super) struct InFlight {
    pub(super) stage: Stage,
    status: ChunkStatus,
    notice: Vec<u8>,
    slot: Option<usize>,
    per_block: bool,
    posted: Posted,
    started: Instant,
    deadline: Instant,
    pub(super) transfer_time: Option<Duration>,
}

impl State {
    /// Fails a chunk: its notice tells the decode; a request NIXL may still be moving is kept
    /// until it is done with it (and its slot with it), else the slot is freed at once (no data
    /// notice will reach the decode). A packing still running into the slot is harmless: the
    /// next packing runs after it on the same stream.
    pub(super) fn fail(&mut self, chunk: &mut InFlight, reason: String) -> Error {
        let status = ChunkStatus {
            result: ChunkResult::Failed {
                reason: reason.clone(),
            },
            ..chunk.status.clone()
        };
        // Best effort: a gone peer cannot hear it, and the channel tells it anyway.
        let _ = self.notify(&Notice::Chunk {
            status,
            bounced: Vec::new(),
        });
        match std::mem::replace(&mut chunk.stage, Stage::Failed(reason.clone())) {
            Stage::Moving { request, .. } => self.zombies.push((request, chunk.slot)),
            _ => self.release_slot(chunk.slot, true),
        }
        Error::Nixl {
            call: "transfer",
            reason,
        }
    }

    /// Posts a packed or direct chunk.
    fn post(&mut self, chunk: &mut InFlight, li: &[i32], ri: &[i32]) -> Result<()> {
        let t0 = Instant::now();
        let Some(peer) = self.peer.as_ref() else {
            return Err(Error::Nixl {
                call: "postXferReq",
                reason: "not connected to a decode side".into(),
            });
        };
        let request = self.agent.make_write(
            &peer.local,
            li,
            &peer.remote_list,
            ri,
            &chunk.notice,
            chunk.per_block,
        )?;
        self.agent.post(&request)?;
        let now = Instant::now();
        chunk.posted.post_time += now - t0;
        self.stats.posted(&chunk.posted);
        chunk.stage = Stage::Moving {
            request,
            posted: now,
        };
        Ok(())
    }

    /// Moves a chunk forward; `Ok(true)` once it has landed, an error once it failed.
    pub(super) fn advance(&mut self, chunk: &mut InFlight) -> Result<bool> {
        loop {
            let gone = self
                .peer
                .as_ref()
                .map_or(Some("not connected".to_string()), |p| p.gone.clone());
            match &chunk.stage {
                Stage::Done => return Ok(true),
                Stage::Announced => {
                    let key = (chunk.status.request, chunk.status.chunk);
                    if self.peer.as_mut().is_some_and(|p| p.taken.remove(&key)) {
                        chunk.stage = Stage::Done;
                        return Ok(true);
                    }
                    let late =
                        |t| format!("the decode side did not take the chunk's notice within {t:?}");
                    return self.still_waiting(chunk, gone, late);
                }
                Stage::Failed(why) => {
                    return Err(Error::Nixl {
                        call: "transfer",
                        reason: why.clone(),
                    })
                }
                Stage::Packing { event, .. } => {
                    if let Some(why) = gone {
                        return Err(self.fail(chunk, format!("the decode side is gone: {why}")));
                    }
                    let packed = self.device.backend().is_done(event);
                    let packed = match packed {
                        Ok(packed) => packed,
                        Err(e) => return Err(self.fail(chunk, format!("packing failed: {e}"))),
                    };
                    if !packed {
                        if Instant::now() > chunk.deadline {
                            let e = self.fail(chunk, "packing did not finish in time".into());
                            return Err(e);
                        }
                        return Ok(false);
                    }
                    let (li, ri) = match &mut chunk.stage {
                        Stage::Packing { li, ri, .. } => (std::mem::take(li), std::mem::take(ri)),
                        _ => (Vec::new(), Vec::new()),
                    };
                    if let Err(e) = self.post(chunk, &li, &ri) {
                        return Err(self.fail(chunk, e.to_string()));
                    }
                }
                Stage::Moving { request, posted } => {
                    let posted = *posted;
                    match self.agent.progress(request) {
                        Ok(Progress::Done) => {
                            let nixl = Agent::telemetry(request)
                                .map(|t| Duration::from_micros(t.xfer_duration_us));
                            let before_post = posted.saturating_duration_since(chunk.started);
                            chunk.transfer_time =
                                Some(before_post + nixl.unwrap_or_else(|| posted.elapsed()));
                            if let Some(slot) = chunk.slot {
                                // The decode frees the remote side once it has scattered.
                                if let Some(s) =
                                    self.peer.as_mut().and_then(|p| p.slots.get_mut(slot))
                                {
                                    s.sending = false;
                                }
                            }
                            chunk.stage = Stage::Done;
                            return Ok(true);
                        }
                        Ok(Progress::Moving) => {
                            let late = |t| format!("not landed {t:?} after it was posted");
                            return self.still_waiting(chunk, gone, late);
                        }
                        Err(e) => {
                            // NIXL is done with a failed request: no notice follows it, and
                            // it can be released now.
                            let slot = chunk.slot;
                            chunk.stage = Stage::Done;
                            let e = self.fail(chunk, e.to_string());
                            self.release_slot(slot, true);
                            return Err(e);
                        }
                    }
                }
            }
        }
    }

    /// A chunk not done yet: failed when the decode side is `gone` (why) or past its deadline
    /// (`late` of the timeout says what did not happen in time), else still waiting
    /// (`Ok(false)`).
    fn still_waiting(
        &mut self,
        chunk: &mut InFlight,
        gone: Option<String>,
        late: impl FnOnce(Duration) -> String,
    ) -> Result<bool> {
        if let Some(why) = gone {
            return Err(self.fail(chunk, format!("the decode side is gone: {why}")));
        }
        if Instant::now() > chunk.deadline {
            let why = late(self.config.transfer_timeout);
            return Err(self.fail(chunk, why));
        }
        Ok(false)
    }

    /// Picks a free slot for a chunk whose sections fit, when the mode and rule say bounce.
    fn pick_slot(&self, plan: &SendPlan) -> Option<usize> {
        let peer = self.peer.as_ref()?;
        let mode = self.config.mode;
        if matches!(mode, NixlMode::Coalesced | NixlMode::PerBlock) || peer.slots.is_empty() {
            return None;
        }
        let sections: Vec<&Section> = plan
            .sections()
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect();
        let fits = sections
            .iter()
            .all(|s| s.owned_pages() as u64 <= peer.local_layout.slot_pages);
        if !fits || sections.is_empty() {
            return None;
        }
        if mode == NixlMode::Auto {
            let descriptors = plan.descriptor_count() as u64;
            let mean = plan.bytes().total() / descriptors.max(1);
            if mean >= self.config.bounce_below {
                return None;
            }
        }
        peer.slots.iter().position(|s| !s.sending && !s.remote_busy)
    }

    /// Checks this connection can carry a chunk of `request` into `dst` (the destination its
    /// connect returned), after taking the peer's notifications.
    pub(super) fn check_peer(&mut self, request: u64, dst: &RemoteSpace) -> Result<()> {
        self.progress();
        let Some(peer) = self.peer.as_ref() else {
            return Err(Error::Transfer {
                request,
                reason: "the NIXL transport is not connected to a decode side".into(),
            });
        };
        if let Some(why) = &peer.gone {
            return Err(Error::Transfer {
                request,
                reason: format!("the decode side is gone: {why}"),
            });
        }
        if dst.id() != peer.remote.id() {
            return Err(Error::InvalidArgument(
                "a NIXL transport moves into the destination its connect returned".into(),
            ));
        }
        Ok(())
    }

    /// Takes a bounce slot free on both sides (held until [`Self::submit_dense`]'s chunk is
    /// done with it, or [`Self::release_slot`]), and its memory, if any.
    pub(super) fn take_slot(&mut self) -> Option<(usize, crate::backend::Buffer)> {
        let peer = self.peer.as_mut()?;
        let s = peer
            .slots
            .iter()
            .position(|s| !s.sending && !s.remote_busy)?;
        let slot = &mut peer.slots[s];
        slot.sending = true;
        slot.remote_busy = true;
        Some((s, slot.space.buffer().clone()))
    }

    /// The deadline of a chunk submitted at `started`. A timeout past any instant
    /// (`Duration::MAX`) is none: a deadline centuries away, never an overflow.
    fn deadline(&self, started: Instant) -> Instant {
        started
            .checked_add(self.config.transfer_timeout)
            .unwrap_or_else(|| started + Duration::from_secs(100 * 365 * 24 * 3600))
    }

    /// A chunk that moves no bytes: its notice goes alone, and it completes once the decode
    /// says it took it.
    pub(super) fn announce(&mut self, status: ChunkStatus, started: Instant) -> Result<InFlight> {
        self.notify(&Notice::Chunk {
            status: status.clone(),
            bounced: Vec::new(),
        })?;
        let posted = Posted {
            post_time: started.elapsed(),
            ..Posted::default()
        };
        self.stats.posted(&posted);
        Ok(InFlight {
            stage: Stage::Announced,
            status,
            notice: Vec::new(),
            slot: None,
            per_block: false,
            posted,
            started,
            deadline: self.deadline(started),
            transfer_time: Some(Duration::ZERO),
        })
    }

    /// A chunk's rows for a decode context-parallel rank, being packed (until `event`) into
    /// the first `bytes` of slot `slot` ([`Self::take_slot`]): posted as one descriptor, that
    /// prefix of the slot into the same prefix of the decode's slot, with `dense` riding on
    /// its notice, once the packing has run.
    pub(super) fn submit_dense(
        &mut self,
        status: ChunkStatus,
        dense: Dense,
        bytes: u64,
        event: Event,
        started: Instant,
    ) -> Result<InFlight> {
        let slot = dense.slot as usize;
        let peer = self.peer.as_mut().ok_or_else(|| Error::Transfer {
            request: status.request,
            reason: "the NIXL transport is not connected to a decode side".into(),
        })?;
        let (li, ri) = (
            vec![peer.local_layout.whole(slot, bytes)],
            vec![peer.remote_layout.whole(slot, bytes)],
        );
        if slot >= peer.slots.len() {
            return Err(Error::InvalidArgument(format!(
                "bounce slot {slot} of the connection"
            )));
        }
        let moved = match &status.result {
            ChunkResult::Sent { bytes, .. } => bytes.total(),
            ChunkResult::Failed { .. } => 0,
        };
        let notice = Notice::Dense {
            status: status.clone(),
            dense,
        }
        .encode();
        let notice = match notice {
            Ok(n) => n,
            Err(e) => {
                self.release_slot(Some(slot), true);
                return Err(e);
            }
        };
        let mut chunk = InFlight {
            stage: Stage::Packing { event, li, ri },
            status,
            notice,
            slot: Some(slot),
            per_block: false,
            posted: Posted {
                bytes: moved,
                descriptors: 1,
                post_time: started.elapsed(),
                bounced: true,
            },
            started,
            deadline: self.deadline(started),
            transfer_time: None,
        };
        // Posted at once when the packing has already run (the CPU twin), else at the first
        // poll that finds it done.
        self.advance(&mut chunk)?;
        Ok(chunk)
    }

    /// Submits `plan`'s chunk (started at `started`): checked against the connection, its
    /// descriptors listed (into a bounce slot when one is free and fits, else block by block),
    /// its notice encoded; then packed into the slot and posted once packed, or posted at once.
    pub(super) fn submit(
        &mut self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
        started: Instant,
    ) -> Result<InFlight> {
        self.progress();
        self.check_submit(plan, src, dst)?;
        let chunk = plan.chunk();
        let status = ChunkStatus {
            request: plan.request(),
            rank: plan.rank(),
            chunk: chunk.index,
            result: ChunkResult::Sent {
                bytes: plan.bytes(),
                last: chunk.last,
            },
        };
        let deadline = self.deadline(started);
        if plan.is_empty() {
            return self.announce(status, started);
        }
        let slot = self.pick_slot(plan);
        let per_block = self.config.mode == NixlMode::PerBlock;
        let lists = self.lists(plan, src, slot, per_block)?;
        let notice = Notice::Chunk {
            status: status.clone(),
            bounced: lists.bounced,
        }
        .encode()?;
        let mut chunk = InFlight {
            stage: Stage::Done,
            status,
            notice,
            slot,
            per_block,
            posted: Posted {
                bytes: plan.bytes().total(),
                descriptors: lists.descriptors,
                post_time: Duration::ZERO,
                bounced: slot.is_some(),
            },
            started,
            deadline,
            transfer_time: None,
        };
        if let Some(s) = slot {
            self.pack(&mut chunk, s, src, &lists.packs, lists.li, lists.ri)?;
        } else {
            chunk.posted.post_time = started.elapsed();
            self.post(&mut chunk, &lists.li, &lists.ri)?;
        }
        Ok(chunk)
    }

    /// Refuses a chunk when no decode side is connected or it is gone, or when the chunk's
    /// spaces are not the pool registered and the destination the connection returned.
    fn check_submit(
        &self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
    ) -> Result<()> {
        let Some(peer) = self.peer.as_ref() else {
            return Err(Error::Transfer {
                request: plan.request(),
                reason: "the NIXL transport is not connected to a decode side".into(),
            });
        };
        if let Some(why) = &peer.gone {
            return Err(Error::Transfer {
                request: plan.request(),
                reason: format!("the decode side is gone: {why}"),
            });
        }
        if src.id() != self.pool.id() || dst.id() != peer.remote.id() {
            return Err(Error::InvalidArgument(
                "a NIXL transport moves from the pool it registered into the destination its connect returned".into(),
            ));
        }
        plan.check_spaces(src.as_ref(), dst.as_ref())
    }

    /// The descriptor lists of `plan`'s sections: into bounce slot `slot` (a prefix of each
    /// component, with the packings that fill it and the notice's account of it), or block by
    /// block from the pool's pages to the decode's.
    fn lists(
        &self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        slot: Option<usize>,
        per_block: bool,
    ) -> Result<Lists> {
        let components = self.pool.geometry().components();
        let peer = self
            .peer
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("no peer".into()))?;
        let mut lists = Lists::default();
        for section in plan.sections() {
            if section.is_empty() {
                continue;
            }
            let owned = section.owned();
            match slot {
                Some(s) => {
                    let space = peer.slots[s].space.clone();
                    let k = owned.len() as u64;
                    let mut codes = Vec::new();
                    for sc in section.components() {
                        let c = component_index(&components, sc.component)?;
                        lists.li.push(peer.local_layout.prefix(s, c, k));
                        lists.ri.push(peer.remote_layout.prefix(s, c, k));
                        codes.push(component_code(sc.component));
                        lists.descriptors += 1;
                    }
                    let comps: Vec<_> = section.components().iter().map(|c| c.component).collect();
                    let pack = BlockCopyPlan::new(
                        src.as_ref(),
                        PageSelection::Local(owned.src_pages().to_vec()),
                        space.as_ref(),
                        PageSelection::Positions,
                        owned.len(),
                    )?
                    .only_components(src.as_ref(), &comps);
                    lists.packs.push((pack, space));
                    lists.bounced.push(Bounced {
                        slot: s as u32,
                        components: codes,
                        pages: owned.dst_pages().iter().map(|p| p.0).collect(),
                    });
                }
                None => {
                    for sc in section.components() {
                        let c = component_index(&components, sc.component)?;
                        for layer in 0..sc.layers {
                            for (sp, dp) in owned.src_pages().iter().zip(owned.dst_pages()) {
                                lists.li.push(peer.local_layout.block(c, layer, sp.0));
                                lists.ri.push(peer.remote_layout.block(c, layer, dp.0));
                            }
                        }
                    }
                    lists.descriptors += if per_block {
                        section.uncoalesced_count()
                    } else {
                        section.descriptor_count()
                    } as u64;
                }
            }
        }
        Ok(lists)
    }

    /// Launches `packs` (the pool's pages into bounce slot `s`), marks the slot busy on both
    /// sides, and leaves `chunk` to be posted (`li`, `ri`) once the packing has run.
    fn pack(
        &mut self,
        chunk: &mut InFlight,
        s: usize,
        src: &Arc<DevicePool>,
        packs: &[(BlockCopyPlan, Arc<BounceSpace>)],
        li: Vec<i32>,
        ri: Vec<i32>,
    ) -> Result<()> {
        let backend = self.device.backend();
        let launch = Launch {
            ctas: 264,
            threads: backend.max_threads(KernelFamily::Copy).min(512),
        };
        let src_space: Arc<dyn BlockSpace> = src.clone();
        for (pack, space) in packs {
            let dst_space: Arc<dyn BlockSpace> = space.clone();
            self.store.launch(pack, &src_space, &dst_space, launch)?;
        }
        let event = backend.record()?;
        if let Some(p) = self.peer.as_mut() {
            p.slots[s].sending = true;
            p.slots[s].remote_busy = true;
        }
        chunk.posted.post_time = chunk.started.elapsed();
        chunk.stage = Stage::Packing { event, li, ri };
        // Posted at once when the packing has already run (the CPU twin), else at the first
        // poll that finds it done.
        self.advance(chunk)?;
        Ok(())
    }
}

/// A chunk's descriptor lists (local and remote, as NIXL's prepared lists index them) and
/// what goes with them.
#[derive(Default)]
struct Lists {
    li: Vec<i32>,
    ri: Vec<i32>,
    /// Descriptors the chunk moves (coalesced runs, or blocks per block).
    descriptors: u64,
    /// Bounced sections, for the notice.
    bounced: Vec<Bounced>,
    /// The packings into the bounce slot, with the slot's space.
    packs: Vec<(BlockCopyPlan, Arc<BounceSpace>)>,
}
