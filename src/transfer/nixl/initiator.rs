//! The prefill side: [`NixlTransport`], a [`Transport`] that writes each chunk into the decode
//! pool with one NIXL transfer request made by indices into descriptor lists prepared once per
//! peer (module docs of [`super`]).
//!
//! By job: this file is the transport's face (connect, report, stats, the [`Transport`] impl
//! and each chunk's [`Completion`]); `connection` holds what the transport keeps per decode
//! peer, `chunks` moves one chunk through it, `lists` is the index math of the prepared lists.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::agent::Agent;
use super::chunks::{InFlight, Stage};
use super::connection::State;
use super::notice::Notice;
use super::registration::NixlBackend;
use super::{geometry_of, wire_geometry, NixlConfig, NixlMode};
use crate::copy::{RemoteSpace, TableStore};
use crate::error::{Error, Result};
use crate::ipc::wire::NixlPeer;
use crate::lock::lock;
use crate::pool::DevicePool;
use crate::transfer::plan::SendPlan;
use crate::transfer::stats::TransferStats;
use crate::transfer::transport::{Completion, Transport};
use crate::transfer::ChunkStatus;

/// How long [`Completion::wait_sync`] sleeps between looks at a moving transfer.
const WAIT_STEP: Duration = Duration::from_micros(20);

/// A [`Transport`] on NIXL for one prefill rank: clones share one agent and connection, so an
/// engine boxes one into its [`Sender`](crate::transfer::Sender) and keeps another to connect,
/// report failures and read the stats.
#[derive(Clone)]
pub struct NixlTransport {
    pub(super) state: Arc<Mutex<State>>,
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
        Self::counting_into(device, pool, config, TransferStats::new("nixl"))
    }

    /// [`Self::new`], counting into `stats` (a decode group's members count into one).
    pub(super) fn counting_into(
        device: NixlBackend,
        pool: Arc<DevicePool>,
        config: NixlConfig,
        stats: TransferStats,
    ) -> Result<Self> {
        device.check()?;
        device.check_space(pool.as_ref(), "the prefill pool")?;
        if config.transfer_timeout.is_zero() {
            return Err(Error::out_of_bounds(
                "a NIXL transfer timeout",
                "0 s",
                "more than zero: every transfer would fail at once",
            ));
        }
        let agent = Agent::new(&config.agent)?;
        // SAFETY: the state holds `pool` for as long as the registrations.
        let registrations = unsafe { device.register_pool(&agent, &pool)? };
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
        // `Duration::MAX` and the like: no deadline, rather than an overflow panic.
        let deadline = Instant::now().checked_add(timeout);
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
            if deadline.is_some_and(|d| Instant::now() >= d) {
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

/// A NIXL chunk's completion.
pub(super) struct NixlCompletion {
    state: Arc<Mutex<State>>,
    chunk: Option<InFlight>,
}

impl NixlCompletion {
    /// The completion of `chunk`, submitted through `transport`'s connection.
    pub(super) fn new(transport: &NixlTransport, chunk: InFlight) -> Self {
        Self {
            state: transport.state.clone(),
            chunk: Some(chunk),
        }
    }
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
