//! The prefill side: [`NixlTransport`], a [`Transport`] that writes each chunk into the decode
//! pool with one NIXL transfer request made by indices into descriptor lists prepared once per
//! peer (module docs of [`super`]).

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nixl_sys::{RegistrationHandle, XferRequest};

use super::memory::{component_index, BounceSpace, NixlBackend};
use super::notice::{component_code, Bounced, Notice};
use super::runtime::{Agent, Memory, Prepared, Progress};
use super::{geometry_of, wire_geometry, NixlConfig, NixlMode};
use crate::backend::{Buffer, Event, KernelFamily, Launch};
use crate::copy::{BlockCopyPlan, BlockSpace, PageSelection, RemoteSpace, TableStore};
use crate::error::{Checked, Error, Result};
use crate::geometry::{CacheGeometry, ComponentLayout};
use crate::ipc::wire::NixlPeer;
use crate::lock::lock;
use crate::pool::DevicePool;
use crate::transfer::plan::{Section, SendPlan};
use crate::transfer::stats::{Posted, TransferStats};
use crate::transfer::transport::{Completion, Transport};
use crate::transfer::{ChunkResult, ChunkStatus};

/// How long [`Completion::wait_sync`] sleeps between looks at a moving transfer.
const WAIT_STEP: Duration = Duration::from_micros(20);

/// Index math of one side's prepared list: the pool's blocks (`[component][layer][page]`),
/// then every prefix of every bounce slot (`[slot][component][pages - 1]`).
#[derive(Debug, Clone)]
pub(crate) struct ListLayout {
    pages: u64,
    component_offsets: Vec<u64>,
    pool_blocks: u64,
    components: u64,
    slot_pages: u64,
    slots: u64,
}

impl ListLayout {
    pub fn new(
        components: &[ComponentLayout],
        pages: u64,
        slot_pages: u64,
        slots: u64,
    ) -> Result<Self> {
        let what = || format!("descriptors of a {pages}-page pool");
        let mut offsets = Vec::with_capacity(components.len());
        let mut blocks = 0u64;
        for c in components {
            offsets.push(blocks);
            blocks = (c.layers() as u64)
                .mul_or(pages, what)?
                .add_or(blocks, what)?;
        }
        let layout = Self {
            pages,
            component_offsets: offsets,
            pool_blocks: blocks,
            components: components.len() as u64,
            slot_pages,
            slots,
        };
        // Every index must fit the i32 NIXL takes.
        let len = layout.len()?;
        if len > i32::MAX as u64 {
            return Err(Error::overflow(format!(
                "{len} prepared descriptors (NIXL indexes lists with i32)"
            )));
        }
        Ok(layout)
    }

    fn len(&self) -> Result<u64> {
        let what = || "prepared descriptors".to_string();
        self.slots
            .mul_or(self.components, what)?
            .mul_or(self.slot_pages, what)?
            .add_or(self.pool_blocks, what)
    }

    /// Block (component index `c`, stored layer, page).
    fn block(&self, c: usize, layer: usize, page: u64) -> i32 {
        // In range: the layout was checked to fit i32, and callers pass pages and layers the
        // plan checked against the spaces.
        (self.component_offsets[c] + layer as u64 * self.pages + page) as i32
    }

    /// The first `k` (>= 1) pages of component index `c` of slot `slot`.
    fn prefix(&self, slot: usize, c: usize, k: u64) -> i32 {
        (self.pool_blocks + (slot as u64 * self.components + c as u64) * self.slot_pages + k - 1)
            as i32
    }

    /// The (address, bytes) of every entry, in index order: `layer_base(c, l)` of the pool and
    /// `slot_base(s, c)` of each slot component.
    pub fn descriptors(
        &self,
        components: &[ComponentLayout],
        layer_base: impl Fn(usize, usize) -> u64,
        slot_base: impl Fn(usize, usize) -> u64,
    ) -> Vec<(u64, u64)> {
        let mut out = Vec::with_capacity(self.len().unwrap_or(0) as usize);
        for (c, comp) in components.iter().enumerate() {
            let block = comp.block_bytes as u64;
            for l in 0..comp.layers() {
                let base = layer_base(c, l);
                out.extend((0..self.pages).map(|p| (base + p * block, block)));
            }
        }
        for s in 0..self.slots as usize {
            for (c, comp) in components.iter().enumerate() {
                let base = slot_base(s, c);
                let page = comp.page_bytes() as u64;
                out.extend((1..=self.slot_pages).map(|k| (base, k * page)));
            }
        }
        out
    }
}

/// One bounce slot of the connection.
struct Slot {
    space: Arc<BounceSpace>,
    /// A chunk of this side is packing into it or moving out of it.
    sending: bool,
    /// The decode side has not freed it yet.
    remote_busy: bool,
}

/// The decode side this rank sends to.
struct Peer {
    agent: String,
    remote: Arc<RemoteSpace>,
    /// Prepared lists (released before the registrations below).
    local: Prepared,
    remote_list: Prepared,
    local_layout: ListLayout,
    remote_layout: ListLayout,
    slots: Vec<Slot>,
    /// Why the peer is gone, once it is.
    gone: Option<String>,
    /// Deregistered before the buffer below is freed (fields drop in order).
    _slot_registration: Option<RegistrationHandle>,
    _slot_buffer: Option<Buffer>,
}

/// Where one chunk stands.
enum Stage {
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
    /// Landed.
    Done,
    /// Failed (the failure notice has been sent).
    Failed(String),
}

/// A submitted chunk.
struct InFlight {
    stage: Stage,
    status: ChunkStatus,
    notice: Vec<u8>,
    slot: Option<usize>,
    per_block: bool,
    posted: Posted,
    started: Instant,
    deadline: Instant,
    transfer_time: Option<Duration>,
}

/// Everything behind the transport's mutex. Field order is drop order: requests and prepared
/// lists go before the registrations, and those before the agent.
struct State {
    /// Requests given up on (failed while moving) that NIXL may still be moving, with their
    /// slots: released once NIXL is done with them, never while it may touch their memory.
    zombies: Vec<(XferRequest, Option<usize>)>,
    peer: Option<Peer>,
    store: TableStore,
    _pool_registrations: Vec<RegistrationHandle>,
    agent: Agent,
    device: NixlBackend,
    pool: Arc<DevicePool>,
    config: NixlConfig,
    stats: TransferStats,
}

/// A [`Transport`] on NIXL for one prefill rank: clones share one agent and connection, so an
/// engine boxes one into its [`Sender`](crate::transfer::Sender) and keeps another to connect,
/// report failures and read the stats.
#[derive(Clone)]
pub struct NixlTransport {
    state: Arc<Mutex<State>>,
    stats: TransferStats,
}

impl fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = lock(&self.state);
        f.debug_struct("NixlTransport")
            .field("agent", &s.agent.name())
            .field("mode", &s.config.mode)
            .field("peer", &s.peer.as_ref().map(|p| p.agent.clone()))
            .finish_non_exhaustive()
    }
}

impl NixlTransport {
    /// Creates this rank's agent and registers `pool` (memory of `device`'s backend).
    ///
    /// A missing NIXL library is [`Error::NixlUnavailable`], saying what to install.
    pub fn new(device: NixlBackend, pool: Arc<DevicePool>, config: NixlConfig) -> Result<Self> {
        device.check()?;
        device.check_space(pool.as_ref(), "the prefill pool")?;
        let agent = Agent::new(&config.agent)?;
        // SAFETY: the state holds `pool` for as long as the registrations.
        let registrations = unsafe { device.register_pool(&agent, &pool)? };
        let stats = TransferStats::new("nixl");
        let state = State {
            zombies: Vec::new(),
            peer: None,
            store: TableStore::new(device.backend()),
            _pool_registrations: registrations,
            agent,
            device,
            pool,
            config,
            stats: stats.clone(),
        };
        Ok(Self {
            state: Arc::new(Mutex::new(state)),
            stats,
        })
    }

    /// What to send the decode side: this rank's agent and geometry (no memory: the decode
    /// never writes here).
    pub fn peer_info(&self) -> Result<NixlPeer> {
        let s = lock(&self.state);
        let (target, draft) = wire_geometry(s.pool.geometry());
        Ok(NixlPeer {
            agent: s.agent.name().to_string(),
            metadata: s.agent.metadata()?,
            target,
            draft,
            vram: s.device.memory().vram,
            device: s.device.memory().device as u32,
            pages: 0,
            layers: Vec::new(),
            slot_pages: 0,
            slots: Vec::new(),
        })
    }

    /// Connects to the decode side `peer` describes: checks its geometry against this pool's
    /// (another geometry refuses it, changing nothing), loads its agent, allocates and
    /// registers this side's bounce slots to match the decode's, and prepares both descriptor
    /// lists. Returns the destination to open requests with
    /// ([`Sender::open`](crate::transfer::Sender::open)). A previous connection is closed
    /// first.
    pub fn connect(&self, peer: &NixlPeer) -> Result<Arc<RemoteSpace>> {
        let mut s = lock(&self.state);
        s.disconnect();
        let geometry = geometry_of(&peer.target, peer.draft.as_ref())?;
        s.pool.geometry().validate_pd(&geometry)?;
        let components = geometry.components();
        if peer.layers.len() != components.len()
            || components
                .iter()
                .zip(&peer.layers)
                .any(|(c, l)| l.len() != c.layers())
        {
            return Err(Error::GeometryMismatch {
                what: "the decode's published layers".into(),
                expected: format!(
                    "{:?}",
                    components.iter().map(|c| c.layers()).collect::<Vec<_>>()
                ),
                got: format!("{:?}", peer.layers.iter().map(Vec::len).collect::<Vec<_>>()),
            });
        }
        let remote = Arc::new(RemoteSpace::unmapped(
            geometry.clone(),
            peer.pages,
            peer.layers.clone(),
        )?);
        let bounce = s.config.mode != NixlMode::Coalesced
            && s.config.mode != NixlMode::PerBlock
            && peer.slot_pages > 0;
        let (slot_pages, nslots) = if bounce {
            (peer.slot_pages, peer.slots.len())
        } else {
            (0, 0)
        };
        let name = s.agent.load_remote(&peer.metadata)?;
        let connected = s.prepare(&name, &geometry, peer, remote.clone(), slot_pages, nslots);
        match connected {
            Ok(p) => {
                s.peer = Some(p);
                Ok(remote)
            }
            Err(e) => {
                s.agent.forget(&name);
                Err(e)
            }
        }
    }

    /// The decode side is gone (its control channel said so): every chunk still moving fails
    /// and the connection's lists, slots and the peer's metadata are released. Later chunks
    /// fail until [`Self::connect`] is called again.
    pub fn peer_gone(&self, why: &str) {
        let mut s = lock(&self.state);
        if let Some(p) = s.peer.as_mut() {
            p.gone.get_or_insert_with(|| why.to_string());
        }
    }

    /// Tells the decode side a status the [`Sender`](crate::transfer::Sender) produced without
    /// this transport (a chunk whose plan was refused, an abort): the decode's request then
    /// fails for this rank.
    pub fn report(&self, status: &ChunkStatus) -> Result<()> {
        let s = lock(&self.state);
        s.notify(&Notice::Chunk {
            status: status.clone(),
            bounced: Vec::new(),
        })
    }

    /// This transport's counters.
    pub fn transfer_stats(&self) -> TransferStats {
        self.stats.clone()
    }

    /// Blocks the host up to `timeout` until every bounce slot is free on both sides (the
    /// decode side has scattered every bounced chunk); whether they are. Chunks never wait for
    /// a slot (a chunk that finds none goes coalesced): an engine that wants the next chunk
    /// bounced, a benchmark say, waits here first.
    pub fn wait_for_slots_sync(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut s = lock(&self.state);
                s.progress();
                let free = s
                    .peer
                    .as_ref()
                    .is_none_or(|p| p.slots.iter().all(|x| !x.sending && !x.remote_busy));
                if free {
                    return true;
                }
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(WAIT_STEP);
        }
    }

    /// Posts later chunks with `mode` (benchmarks compare modes on one connection). Bouncing
    /// needs the slots a connection made in [`NixlMode::Auto`] or [`NixlMode::Bounce`] sets
    /// up; without them chunks go coalesced.
    pub fn set_mode(&self, mode: NixlMode) {
        lock(&self.state).config.mode = mode;
    }
}

impl State {
    /// Closes the connection (if any): releases its lists and slots, then forgets the peer's
    /// agent. In that order: a prepared list of a peer refers to what NIXL holds of it, and
    /// releasing it after the peer was forgotten corrupts NIXL's heap.
    fn disconnect(&mut self) {
        if let Some(p) = self.peer.take() {
            let agent = p.agent.clone();
            drop(p);
            self.agent.forget(&agent);
        }
    }

    fn prepare(
        &mut self,
        name: &str,
        geometry: &CacheGeometry,
        peer: &NixlPeer,
        remote: Arc<RemoteSpace>,
        slot_pages: u64,
        nslots: usize,
    ) -> Result<Peer> {
        let components = geometry.components();
        let memory = self.device.memory();
        let backend = self.device.backend();
        let (slot_buffer, spaces, registration) = if nslots > 0 {
            let (buffer, spaces) =
                BounceSpace::allocate(backend.as_ref(), geometry, slot_pages, nslots)?;
            // SAFETY: the buffer is this side's allocation, kept by the peer (`_slot_buffer`)
            // for as long as the registration, which drops first.
            let reg = unsafe {
                self.device
                    .register(&self.agent, buffer.addr(), buffer.len())?
            };
            (Some(buffer), spaces, Some(reg))
        } else {
            (None, Vec::new(), None)
        };
        let local_layout =
            ListLayout::new(&components, self.pool.pages(), slot_pages, nslots as u64)?;
        let remote_layout = ListLayout::new(&components, peer.pages, slot_pages, nslots as u64)?;
        let pool = &self.pool;
        let device = &self.device;
        let mut bases = Vec::new();
        for comp in &components {
            let bytes = (pool.pages() * comp.block_bytes as u64) as usize;
            let mut layers = Vec::new();
            for &b in pool.layer_bases(comp.component)? {
                layers.push(device.nixl_address(b, bytes)?);
            }
            bases.push(layers);
        }
        let mut slot_bases = Vec::new();
        for space in &spaces {
            let mut per = Vec::new();
            for c in 0..components.len() {
                let (addr, len) = space.prefix(c, slot_pages);
                per.push(device.nixl_address(addr, len as usize)?);
            }
            slot_bases.push(per);
        }
        let local = self.agent.prepare(
            None,
            memory,
            local_layout
                .descriptors(&components, |c, l| bases[c][l], |s, c| slot_bases[s][c])
                .into_iter(),
        )?;
        let (offsets, _) = BounceSpace::layout(geometry, slot_pages.max(1))?;
        let remote_memory = Memory {
            vram: peer.vram,
            device: u64::from(peer.device),
        };
        let remote_list = self.agent.prepare(
            Some(name),
            remote_memory,
            remote_layout
                .descriptors(
                    &components,
                    |c, l| peer.layers[c][l],
                    |s, c| peer.slots[s] + offsets[c] as u64,
                )
                .into_iter(),
        )?;
        Ok(Peer {
            agent: name.to_string(),
            remote,
            local,
            remote_list,
            local_layout,
            remote_layout,
            slots: spaces
                .into_iter()
                .map(|space| Slot {
                    space,
                    sending: false,
                    remote_busy: false,
                })
                .collect(),
            gone: None,
            _slot_registration: registration,
            _slot_buffer: slot_buffer,
        })
    }

    /// Sends a notice to the peer, counting a failure to.
    fn notify(&self, notice: &Notice) -> Result<()> {
        let Some(peer) = &self.peer else {
            self.stats.failed_notification();
            return Err(Error::Nixl {
                call: "genNotif",
                reason: "not connected to a decode side".into(),
            });
        };
        let sent = notice
            .encode()
            .and_then(|bytes| self.agent.notify(&peer.agent, &bytes));
        if sent.is_err() {
            self.stats.failed_notification();
        }
        sent
    }

    /// Takes the peer's notifications (slot releases) and releases the requests given up on
    /// that NIXL is done with.
    fn progress(&mut self) {
        if let Ok(notes) = self.agent.notifications() {
            for (from, bytes) in notes {
                let Some(peer) = self.peer.as_mut() else {
                    break;
                };
                if from != peer.agent {
                    continue;
                }
                if let Ok(Notice::SlotFree { slot }) = Notice::decode(&bytes) {
                    if let Some(s) = peer.slots.get_mut(slot as usize) {
                        s.remote_busy = false;
                    }
                }
            }
        }
        let zombies = std::mem::take(&mut self.zombies);
        for (request, slot) in zombies {
            match self.agent.progress(&request) {
                Ok(Progress::Moving) => self.zombies.push((request, slot)),
                // Landed after all: its notice reached the decode, which frees the slot.
                Ok(Progress::Done) => self.release_slot(slot, false),
                Err(_) => self.release_slot(slot, true),
            }
        }
    }

    /// Frees a chunk's slot on this side; `remote` too when the decode will never see it.
    fn release_slot(&mut self, slot: Option<usize>, remote: bool) {
        if let (Some(slot), Some(peer)) = (slot, self.peer.as_mut()) {
            if let Some(s) = peer.slots.get_mut(slot) {
                s.sending = false;
                if remote {
                    s.remote_busy = false;
                }
            }
        }
    }

    /// Fails a chunk: its notice tells the decode; a request NIXL may still be moving is kept
    /// until it is done with it (and its slot with it), else the slot is freed at once (no data
    /// notice will reach the decode). A packing still running into the slot is harmless: the
    /// next packing runs after it on the same stream.
    fn fail(&mut self, chunk: &mut InFlight, reason: String) -> Error {
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
    fn advance(&mut self, chunk: &mut InFlight) -> Result<bool> {
        loop {
            let gone = self
                .peer
                .as_ref()
                .map_or(Some("not connected".to_string()), |p| p.gone.clone());
            match &chunk.stage {
                Stage::Done => return Ok(true),
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
                            if let Some(why) = gone {
                                let e = self.fail(chunk, format!("the decode side is gone: {why}"));
                                return Err(e);
                            }
                            if Instant::now() > chunk.deadline {
                                let e = self.fail(
                                    chunk,
                                    format!(
                                        "not landed {:?} after it was posted",
                                        self.config.transfer_timeout
                                    ),
                                );
                                return Err(e);
                            }
                            return Ok(false);
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

    fn submit(
        &mut self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
        started: Instant,
    ) -> Result<InFlight> {
        self.progress();
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
        plan.check_spaces(src.as_ref(), dst.as_ref())?;
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
        let deadline = started + self.config.transfer_timeout;
        if plan.is_empty() {
            self.notify(&Notice::Chunk {
                status: status.clone(),
                bounced: Vec::new(),
            })?;
            let posted = Posted {
                post_time: started.elapsed(),
                ..Posted::default()
            };
            self.stats.posted(&posted);
            return Ok(InFlight {
                stage: Stage::Done,
                status,
                notice: Vec::new(),
                slot: None,
                per_block: false,
                posted,
                started,
                deadline,
                transfer_time: Some(Duration::ZERO),
            });
        }
        let slot = self.pick_slot(plan);
        let per_block = self.config.mode == NixlMode::PerBlock;
        let components = self.pool.geometry().components();
        let peer = self
            .peer
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("no peer".into()))?;
        let (mut li, mut ri) = (Vec::new(), Vec::new());
        let mut bounced = Vec::new();
        let mut descriptors = 0u64;
        let mut packs = Vec::new();
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
                        li.push(peer.local_layout.prefix(s, c, k));
                        ri.push(peer.remote_layout.prefix(s, c, k));
                        codes.push(component_code(sc.component));
                        descriptors += 1;
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
                    packs.push((pack, space));
                    bounced.push(Bounced {
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
                                li.push(peer.local_layout.block(c, layer, sp.0));
                                ri.push(peer.remote_layout.block(c, layer, dp.0));
                            }
                        }
                    }
                    descriptors += if per_block {
                        section.uncoalesced_count()
                    } else {
                        section.descriptor_count()
                    } as u64;
                }
            }
        }
        let notice = Notice::Chunk {
            status: status.clone(),
            bounced,
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
                descriptors,
                post_time: Duration::ZERO,
                bounced: slot.is_some(),
            },
            started,
            deadline,
            transfer_time: None,
        };
        if let Some(s) = slot {
            let backend = self.device.backend();
            let launch = Launch {
                ctas: 264,
                threads: backend.max_threads(KernelFamily::Copy).min(512),
            };
            let src_space: Arc<dyn BlockSpace> = src.clone();
            for (pack, space) in &packs {
                let dst_space: Arc<dyn BlockSpace> = space.clone();
                self.store.launch(pack, &src_space, &dst_space, launch)?;
            }
            let event = backend.record()?;
            if let Some(p) = self.peer.as_mut() {
                p.slots[s].sending = true;
                p.slots[s].remote_busy = true;
            }
            chunk.posted.post_time = started.elapsed();
            chunk.stage = Stage::Packing { event, li, ri };
            // Posted at once when the packing has already run (the CPU twin), else at the
            // first poll that finds it done.
            match self.advance(&mut chunk) {
                Ok(_) => {}
                Err(e) => return Err(e),
            }
        } else {
            chunk.posted.post_time = started.elapsed();
            self.post(&mut chunk, &li, &ri)?;
        }
        Ok(chunk)
    }
}

/// A NIXL chunk's completion.
struct NixlCompletion {
    state: Arc<Mutex<State>>,
    chunk: Option<InFlight>,
}

impl Completion for NixlCompletion {
    fn poll(&mut self) -> Result<bool> {
        let Some(chunk) = self.chunk.as_mut() else {
            return Ok(true);
        };
        let mut s = lock(&self.state);
        s.progress();
        s.advance(chunk)
    }

    fn wait_sync(&mut self) -> Result<()> {
        // Bounded: a transfer that has not landed within the transfer timeout fails its poll.
        loop {
            if self.poll()? {
                return Ok(());
            }
            std::thread::sleep(WAIT_STEP);
        }
    }

    fn transfer_time(&self) -> Option<Duration> {
        self.chunk.as_ref().and_then(|c| c.transfer_time)
    }
}

impl Drop for NixlCompletion {
    fn drop(&mut self) {
        let Some(mut chunk) = self.chunk.take() else {
            return;
        };
        let mut s = lock(&self.state);
        if matches!(chunk.stage, Stage::Packing { .. } | Stage::Moving { .. }) {
            // Abandoned: the decode must hear of it; a request NIXL may still be moving is
            // kept until NIXL is done with it (`fail`).
            let _ = s.fail(&mut chunk, "abandoned before it landed".into());
        }
    }
}

impl Transport for NixlTransport {
    fn submit(
        &mut self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
    ) -> Result<Box<dyn Completion>> {
        let started = Instant::now();
        let chunk = {
            let mut s = lock(&self.state);
            s.submit(plan, src, dst, started)
        };
        let completion = chunk.map(|chunk| -> Box<dyn Completion> {
            Box::new(NixlCompletion {
                state: self.state.clone(),
                chunk: Some(chunk),
            })
        });
        // The chunk's posting was counted where it was posted (bounced or not).
        self.stats.submitted(started, completion, || None)
    }

    fn stats(&self) -> Option<TransferStats> {
        Some(self.stats.clone())
    }
}
