//! The decode side: [`NixlTarget`] registers the decode pool and the bounce slots of every
//! prefill rank, turns the ranks' notices into chunk statuses (scattering bounced sections into
//! the pool first), and completes requests with the [`Receiver`], unchanged.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;

use nixl_sys::RegistrationHandle;

use super::agent::Agent;
use super::notice::{component_of, Bounced, Dense, Notice};
use super::registration::{BounceSpace, NixlBackend};
use super::{geometry_of, wire_geometry, NixlConfig};
use crate::backend::{Buffer, Event, KernelFamily, Launch};
use crate::copy::ScatterRank;
use crate::copy::{BlockCopyPlan, BlockSpace, PageSelection, TableStore};
use crate::error::{Error, Result};
use crate::index::LocalPage;
use crate::ipc::wire::{NixlPeer, MAX_NIXL_SLOTS};
use crate::pool::DevicePool;
use crate::shard::DecodeLayout;
use crate::transfer::decode_bounce::{DenseBounce, DenseChunk, DenseSection};
use crate::transfer::{ChunkResult, ChunkStatus, Finished, Overdue, Receiver, Registration};

/// What the decode side knows of one prefill rank.
#[derive(Debug, Clone, PartialEq, Eq)]
enum RankState {
    /// No `NixlPeer` from it yet.
    Unknown,
    /// Connected: its agent's name.
    Connected(String),
    /// Refused (another geometry) or gone: every request it sends fails, why says why.
    Failed(String),
}

/// A status waiting for its bounce scatter to finish.
struct Scatter {
    event: Event,
    status: ChunkStatus,
    slots: Vec<u32>,
}

/// Where one rank stands in one request: the next chunk the Receiver takes from it, statuses
/// that arrived ahead of it, and whether it has reported its last one.
#[derive(Debug, Default)]
struct RankProgress {
    next: u32,
    ahead: BTreeMap<u32, ChunkStatus>,
    done: bool,
}

/// The decode side of NIXL P/D: one agent, the decode pool and `slots` bounce slots per prefill
/// rank registered with it, and the [`Receiver`] of the requests being received.
///
/// Drive it with [`Self::poll`], which takes NIXL's notifications and returns the requests
/// that finished, and [`Self::expire`], which returns those whose deadline passed; tell it
/// about ranks the control channel reports gone ([`Self::rank_gone_sync`]).
pub struct NixlTarget {
    scatters: VecDeque<Scatter>,
    store: TableStore,
    /// Unpacks dense regions (a decode context-parallel rank's chunks).
    dense: DenseBounce,
    receiver: Receiver,
    requests: HashMap<u64, Vec<RankProgress>>,
    /// The pages each request registered (where a dense region's rows land).
    pages: HashMap<u64, ScatterRank>,
    finished: Vec<Finished>,
    ranks: Vec<RankState>,
    /// Per rank, its slots (released before their registration and buffer).
    slots: Vec<Vec<Arc<BounceSpace>>>,
    _registrations: Vec<RegistrationHandle>,
    _slot_buffer: Option<Buffer>,
    agent: Agent,
    device: NixlBackend,
    pool: Arc<DevicePool>,
    config: NixlConfig,
    /// Notifications refused (not a kvshard notice, from an unknown agent, out of place).
    refused: u64,
}

impl fmt::Debug for NixlTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlTarget")
            .field("agent", &self.agent.name())
            .field("ranks", &self.ranks)
            .field("requests", &self.requests.len())
            .finish_non_exhaustive()
    }
}

impl NixlTarget {
    /// Creates the decode agent for `ranks` prefill ranks, registers `pool` and allocates and
    /// registers [`NixlConfig::slots`] bounce slots of [`NixlConfig::slot_pages`] pages per
    /// rank (none when either is 0).
    ///
    /// A missing NIXL library is [`Error::NixlUnavailable`], saying what to install.
    pub fn new(
        device: NixlBackend,
        pool: Arc<DevicePool>,
        ranks: u32,
        config: NixlConfig,
    ) -> Result<Self> {
        device.check()?;
        device.check_space(pool.as_ref(), "the decode pool")?;
        if ranks == 0 || ranks > crate::transfer::MAX_PREFILL_RANKS {
            return Err(Error::InvalidArgument(format!(
                "{ranks} prefill ranks (1 to {})",
                crate::transfer::MAX_PREFILL_RANKS
            )));
        }
        if config.slots > MAX_NIXL_SLOTS {
            return Err(Error::InvalidArgument(format!(
                "{} bounce slots per rank (at most {MAX_NIXL_SLOTS})",
                config.slots
            )));
        }
        let agent = Agent::new(&config.agent)?;
        // SAFETY: the target holds `pool` for as long as the registrations, dropped first.
        let mut registrations = unsafe { device.register_pool(&agent, &pool)? };
        let bounce = config.slot_pages > 0 && config.slots > 0;
        let (slot_buffer, slots) = if bounce {
            let backend = device.backend();
            let total = config.slots * ranks as usize;
            let (buffer, spaces) =
                BounceSpace::allocate(backend.as_ref(), pool.geometry(), config.slot_pages, total)?;
            // SAFETY: this target's allocation, kept (`_slot_buffer`) until the registration
            // has dropped.
            registrations.push(unsafe { device.register(&agent, buffer.addr(), buffer.len())? });
            let per_rank = spaces.chunks(config.slots).map(<[_]>::to_vec).collect();
            (Some(buffer), per_rank)
        } else {
            (None, vec![Vec::new(); ranks as usize])
        };
        Ok(Self {
            scatters: VecDeque::new(),
            store: TableStore::new(device.backend()),
            dense: DenseBounce::new(device.backend()),
            receiver: Receiver::with_deadline(config.deadline),
            requests: HashMap::new(),
            pages: HashMap::new(),
            finished: Vec::new(),
            ranks: vec![RankState::Unknown; ranks as usize],
            slots,
            _registrations: registrations,
            _slot_buffer: slot_buffer,
            agent,
            device,
            pool,
            config,
            refused: 0,
        })
    }

    /// What to send prefill rank `rank`: this agent, the pool's geometry and layer addresses,
    /// and the bounce slots kept for that rank.
    pub fn peer_info(&self, rank: u32) -> Result<NixlPeer> {
        let slots = self.slots.get(rank as usize).ok_or(Error::OutOfRange {
            what: "prefill rank",
            index: i64::from(rank),
            limit: self.ranks.len() as u64,
        })?;
        let (target, draft) = wire_geometry(self.pool.geometry());
        let mut layers = Vec::new();
        for c in self.pool.geometry().components() {
            let bytes = (self.pool.pages() * c.block_bytes as u64) as usize;
            let mut per = Vec::new();
            for &b in self.pool.layer_bases(c.component)? {
                per.push(self.device.nixl_address(b, bytes)?);
            }
            layers.push(per);
        }
        let memory = self.device.memory();
        let mut slot_addrs = Vec::new();
        for s in slots {
            slot_addrs.push(self.device.nixl_address(s.addr(), 1)?);
        }
        Ok(NixlPeer {
            agent: self.agent.name().to_string(),
            metadata: self.agent.metadata()?,
            target,
            draft,
            vram: memory.vram,
            device: memory.device as u32,
            pages: self.pool.pages(),
            layers,
            slot_pages: if slots.is_empty() {
                0
            } else {
                self.config.slot_pages
            },
            slots: slot_addrs,
        })
    }

    /// Takes prefill rank `rank`'s `NixlPeer`: checks its geometry against the pool's (another
    /// geometry refuses the rank: every request it is part of fails, here and, through the
    /// same check, on its side) and loads its agent (to free its bounce slots).
    pub fn connect(&mut self, rank: u32, peer: &NixlPeer) -> Result<()> {
        let slot = self.ranks.get(rank as usize).ok_or(Error::OutOfRange {
            what: "prefill rank",
            index: i64::from(rank),
            limit: self.ranks.len() as u64,
        })?;
        if let RankState::Connected(old) = slot.clone() {
            self.agent.forget(&old);
        }
        let checked = geometry_of(&peer.target, peer.draft.as_ref())
            .and_then(|g| g.validate_pd(self.pool.geometry()));
        if let Err(e) = checked {
            self.fail_rank(rank, &format!("refused: {e}"));
            return Err(e);
        }
        match self.agent.load_remote(&peer.metadata) {
            Ok(name) if name == peer.agent => {
                self.ranks[rank as usize] = RankState::Connected(name);
                Ok(())
            }
            Ok(name) => {
                self.agent.forget(&name);
                let why = format!(
                    "its metadata names agent {name}, its message {}",
                    peer.agent
                );
                self.fail_rank(rank, &why);
                Err(Error::Nixl {
                    call: "loadRemoteMD",
                    reason: why,
                })
            }
            Err(e) => {
                self.fail_rank(rank, &e.to_string());
                Err(e)
            }
        }
    }

    /// Starts receiving a request sent by every prefill rank of this target. Register it before
    /// the ranks hear of it (before sending them its registration): a notice for a request not
    /// registered here is refused, not kept. Ranks already refused or gone fail it at once (the
    /// next [`Self::poll`] returns it when no rank is left writing).
    pub fn register(&mut self, registration: Registration) -> Result<()> {
        let request = registration.request;
        let ranks = self.ranks.len() as u32;
        let pages = ScatterRank {
            pages: registration.pages.clone(),
            state_pages: registration.state_pages.clone(),
        };
        self.receiver.register(registration, ranks)?;
        self.pages.insert(request, pages);
        self.requests.insert(
            request,
            (0..ranks).map(|_| RankProgress::default()).collect(),
        );
        for rank in 0..ranks {
            if let RankState::Failed(why) = self.ranks[rank as usize].clone() {
                self.fail_request_rank(request, rank, &why);
            }
        }
        Ok(())
    }

    /// Prefill rank `rank` is gone (its control channel said so): the notices it sent before
    /// it went are taken first (the chunks they report did land), then every request it was
    /// still sending fails, once its pending scatters here have run (they write the pool):
    /// blocks the host until the device has passed them.
    pub fn rank_gone_sync(&mut self, rank: u32, why: &str) -> Result<()> {
        let taken = self.take_notifications();
        self.fail_rank(rank, &format!("gone: {why}"));
        taken
    }

    /// Takes NIXL's notifications, scatters bounced sections, and returns the requests that
    /// finished (completed or failed), each exactly once.
    pub fn poll(&mut self) -> Result<Vec<Finished>> {
        self.take_notifications()?;
        self.finish_scatters()?;
        Ok(std::mem::take(&mut self.finished))
    }

    /// Takes NIXL's notifications (a status that came counts), then fails and returns, once
    /// each, the requests whose [`NixlConfig::deadline`] passed before every rank's last status
    /// ([`Receiver::expire`]): the request, and the ranks whose last status never came with the
    /// chunks that did (each the [`Error::TransferDeadline`] it converts into). The request is
    /// handed back by [`Self::poll`], failed, once every rank has reported its last status:
    /// tell the ranks named to abort it over the control channel, and report a rank gone
    /// ([`Self::rank_gone_sync`]). Never blocks.
    pub fn expire(&mut self) -> Result<Vec<Overdue>> {
        self.take_notifications()?;
        Ok(self.receiver.expire())
    }

    fn take_notifications(&mut self) -> Result<()> {
        for (from, bytes) in self.agent.notifications()? {
            match Notice::decode(&bytes) {
                Ok(notice) => self.take(&from, notice)?,
                Err(_) => self.refused += 1,
            }
        }
        Ok(())
    }

    /// Requests registered and not yet finished.
    pub fn pending_requests(&self) -> usize {
        self.receiver.pending_requests()
    }

    /// Notifications refused so far (not a kvshard notice, from an unknown agent, or for a
    /// request or chunk that is not expected).
    pub fn refused_notifications(&self) -> u64 {
        self.refused
    }

    /// The rank an agent name belongs to.
    fn rank_of(&self, agent: &str) -> Option<u32> {
        self.ranks
            .iter()
            .position(|r| matches!(r, RankState::Connected(a) if a == agent))
            .map(|r| r as u32)
    }

    /// One notice from agent `from`.
    fn take(&mut self, from: &str, notice: Notice) -> Result<()> {
        let Some(rank) = self.rank_of(from) else {
            self.refused += 1;
            return Ok(());
        };
        let (status, bounced, dense) = match notice {
            Notice::Chunk { status, bounced } => (status, bounced, None),
            Notice::Dense { status, dense } => (status, Vec::new(), Some(dense)),
            // A decode side never receives slot releases.
            _ => {
                self.refused += 1;
                return Ok(());
            }
        };
        let slots: Vec<u32> = match &dense {
            Some(d) => vec![d.slot],
            None => bounced.iter().map(|b| b.slot).collect(),
        };
        let (request, chunk) = (status.request, status.chunk);
        let scattering = |s: &Scatter| {
            (s.status.request, s.status.rank, s.status.chunk) == (request, rank, chunk)
        };
        let progress = self
            .requests
            .get(&request)
            .and_then(|r| r.get(rank as usize))
            .filter(|p| !p.done && status.rank == rank);
        match progress {
            // A repeat of a chunk taken, waiting for an earlier one, or being scattered: its
            // slots belong to the first copy, which frees them.
            Some(p)
                if chunk < p.next
                    || p.ahead.contains_key(&chunk)
                    || self.scatters.iter().any(scattering) =>
            {
                self.refused += 1;
                return Ok(());
            }
            Some(_) => {}
            None => {
                // Not (or no longer) expected: a late notice of a rank that failed, say. Its
                // slots are free all the same (nothing will scatter them), unless a chunk this
                // side is scattering holds one.
                self.refused += 1;
                let busy: Vec<u32> = self
                    .scatters
                    .iter()
                    .filter(|s| s.status.rank == rank)
                    .flat_map(|s| s.slots.iter().copied())
                    .collect();
                let free: Vec<u32> = slots
                    .iter()
                    .copied()
                    .filter(|s| !busy.contains(s))
                    .collect();
                self.free_slots(rank, free.into_iter());
                return Ok(());
            }
        }
        if slots.is_empty() {
            if matches!(&status.result, ChunkResult::Sent { bytes, .. } if bytes.total() == 0) {
                // A notice-only chunk: its rank completes it when it hears this.
                self.taken(rank, status.request, status.chunk);
            }
            self.deliver(status);
            return Ok(());
        }
        let enqueued = match &dense {
            Some(d) => self.unpack(rank, status.request, d),
            None => self.scatter(rank, &bounced),
        };
        match enqueued {
            Ok(event) => self.scatters.push_back(Scatter {
                event,
                status,
                slots,
            }),
            Err(e) => {
                // A notice this side cannot act on fails the request for that rank.
                self.free_slots(rank, slots.into_iter());
                self.deliver(ChunkStatus {
                    result: ChunkResult::Failed {
                        reason: format!("bounce scatter refused: {e}"),
                    },
                    ..status
                });
            }
        }
        Ok(())
    }

    /// Bounce slot `slot` of prefill rank `rank` (a notice names it: an error when there is
    /// none).
    fn slot(&self, rank: u32, slot: u32) -> Result<Arc<BounceSpace>> {
        self.slots
            .get(rank as usize)
            .and_then(|s| s.get(slot as usize))
            .cloned()
            .ok_or_else(|| Error::InvalidArgument(format!("bounce slot {slot} of rank {rank}")))
    }

    /// Enqueues the scatter of every bounced section of a chunk of `rank`; returns the event
    /// after them.
    fn scatter(&mut self, rank: u32, bounced: &[Bounced]) -> Result<Event> {
        let backend = self.device.backend();
        let launch = Launch {
            ctas: 264,
            threads: backend.max_threads(KernelFamily::Copy).min(512),
        };
        let dst: Arc<dyn BlockSpace> = self.pool.clone();
        for b in bounced {
            let space = self.slot(rank, b.slot)?;
            let components = b
                .components
                .iter()
                .map(|&c| component_of(c))
                .collect::<Result<Vec<_>>>()?;
            // Checked in full, here and at launch: destination pages in the pool and distinct,
            // the same components on both sides, no more entries than the slot holds.
            let plan = BlockCopyPlan::new(
                space.as_ref(),
                PageSelection::Positions,
                self.pool.as_ref(),
                PageSelection::Local(b.pages.iter().map(|&p| LocalPage(p)).collect()),
                b.pages.len(),
            )?
            .only_components(space.as_ref(), &components);
            let src: Arc<dyn BlockSpace> = space;
            self.store.launch(&plan, &src, &dst, launch)?;
        }
        backend.record()
    }

    /// Enqueues the unpacking of a dense region prefill rank `rank` bounced to this decode
    /// context-parallel rank for `request`, into the pages the request registered here;
    /// returns the event after it. Everything the notice says is checked (the slot, the layout,
    /// the sections against the slot and the registered pages) before anything is enqueued,
    /// and the kernel re-checks every index it reads.
    fn unpack(&mut self, rank: u32, request: u64, d: &Dense) -> Result<Event> {
        let pages = self.pages.get(&request).ok_or_else(|| {
            Error::InvalidArgument(format!("request {request} is not registered"))
        })?;
        let space = self.slot(rank, d.slot)?;
        let layout = DecodeLayout::new(d.ranks, d.interleave)?;
        if d.rank >= d.ranks {
            return Err(Error::OutOfRange {
                what: "decode rank",
                index: i64::from(d.rank),
                limit: u64::from(d.ranks),
            });
        }
        let sections = d
            .sections
            .iter()
            .map(|(codes, positions)| {
                Ok(DenseSection {
                    components: codes
                        .iter()
                        .map(|&c| component_of(c))
                        .collect::<Result<_>>()?,
                    positions: positions.clone(),
                })
            })
            .collect::<Result<_>>()?;
        let chunk = DenseChunk {
            end_token: d.end_token,
            sections,
        };
        self.dense
            .unpack(&chunk, layout, d.rank, space.buffer(), &self.pool, pages)
    }

    /// Delivers the statuses whose scatters have run, in arrival order, and frees their slots.
    fn finish_scatters(&mut self) -> Result<()> {
        let backend = self.device.backend();
        while let Some(front) = self.scatters.front() {
            if !backend.is_done(&front.event)? {
                break;
            }
            let Some(done) = self.scatters.pop_front() else {
                break;
            };
            let rank = done.status.rank;
            self.free_slots(rank, done.slots.iter().copied());
            self.deliver(done.status);
        }
        Ok(())
    }

    /// Tells rank `rank` this side took the status of its notice-only chunk `chunk` of
    /// `request`.
    fn taken(&mut self, rank: u32, request: u64, chunk: u32) {
        let RankState::Connected(agent) = self.ranks[rank as usize].clone() else {
            return;
        };
        if let Ok(bytes) = (Notice::Taken { request, chunk }).encode() {
            // A rank that cannot hear it is gone, and its chunk fails on its side.
            let _ = self.agent.notify(&agent, &bytes);
        }
    }

    /// Tells rank `rank` its slots may be written again.
    fn free_slots(&mut self, rank: u32, slots: impl Iterator<Item = u32>) {
        let RankState::Connected(agent) = self.ranks[rank as usize].clone() else {
            return;
        };
        for slot in slots {
            if let Ok(bytes) = (Notice::SlotFree { slot }).encode() {
                // A rank that cannot hear it is gone: its slots do not matter any more.
                let _ = self.agent.notify(&agent, &bytes);
            }
        }
    }

    /// Hands a status to the Receiver in chunk order for its (request, rank); a status that
    /// arrived ahead waits for the ones before it.
    fn deliver(&mut self, status: ChunkStatus) {
        let (request, rank) = (status.request, status.rank as usize);
        let Some(progress) = self
            .requests
            .get_mut(&request)
            .and_then(|r| r.get_mut(rank))
        else {
            return;
        };
        if progress.done || status.chunk < progress.next {
            // Already taken (a repeat that raced its first copy's scatter): nothing to add.
            self.refused += 1;
            return;
        }
        progress.ahead.insert(status.chunk, status);
        let mut ready = Vec::new();
        while !progress.done {
            let Some(next) = progress.ahead.remove(&progress.next) else {
                break;
            };
            progress.next += 1;
            progress.done = next.is_terminal();
            ready.push(next);
        }
        if progress.done {
            progress.ahead.clear();
        }
        for status in ready {
            self.receive(status);
        }
    }

    /// Feeds the Receiver; a finished request is queued for `poll` and forgotten here.
    fn receive(&mut self, status: ChunkStatus) {
        let request = status.request;
        match self.receiver.receive(status) {
            Ok(Some(finished)) => {
                self.requests.remove(&request);
                self.pages.remove(&request);
                self.finished.push(finished);
            }
            Ok(None) => {}
            // The order above makes every status one the Receiver expects; one it refuses
            // changes nothing there.
            Err(_) => self.refused += 1,
        }
    }

    /// Fails every open request of `rank` (after its pending scatters, which write the pool)
    /// and every later one, and forgets its agent.
    fn fail_rank(&mut self, rank: u32, why: &str) {
        let Some(state) = self.ranks.get_mut(rank as usize) else {
            return;
        };
        if let RankState::Connected(agent) =
            std::mem::replace(state, RankState::Failed(why.to_string()))
        {
            self.agent.forget(&agent);
        }
        let backend = self.device.backend();
        let mut kept = VecDeque::new();
        for s in std::mem::take(&mut self.scatters) {
            if s.status.rank == rank {
                // Its pages must not be handed back while this side still writes them.
                let _ = backend.wait_event_sync(&s.event);
            } else {
                kept.push_back(s);
            }
        }
        self.scatters = kept;
        let open: Vec<u64> = self.requests.keys().copied().collect();
        for request in open {
            self.fail_request_rank(request, rank, why);
        }
    }

    /// Fails `request` for `rank` at the chunk the Receiver expects next from it.
    fn fail_request_rank(&mut self, request: u64, rank: u32, why: &str) {
        let Some(progress) = self
            .requests
            .get_mut(&request)
            .and_then(|r| r.get_mut(rank as usize))
        else {
            return;
        };
        if progress.done {
            return;
        }
        progress.ahead.clear();
        progress.done = true;
        let chunk = progress.next;
        self.receive(ChunkStatus {
            request,
            rank,
            chunk,
            result: ChunkResult::Failed {
                reason: format!("prefill rank {rank} {why}"),
            },
        });
    }
}
