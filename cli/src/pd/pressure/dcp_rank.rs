//! A prefill rank's sends into decode context-parallel groups (docs/pd.md, "Into DCP decode
//! groups"): the rank maps every decode rank's published pool, takes each group's
//! registration of each prompt from the group's rank 0, opens the prompt with
//! `Sender::open_decode` (one launch per chunk and group writes every decode rank's rows), and
//! reports each chunk, once it has landed, to each decode rank of the group with that rank's
//! status (`PendingChunk::poll_each`) on the rank's control channel.
//!
//! The decode side is the library's `DecodeEndpoint`, one per decode rank: its `Receiver`
//! registered the rank's share, and takes a status as landed when it comes (no interprocess
//! event is shared: the rank reports a chunk only after it has landed, on the GPU as on the
//! CPU twin).

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard::backend::Backend;
use kvshard::chain::RequestChain;
use kvshard::ipc::wire::{self, Hello, Register};
use kvshard::ipc::{Channel, ImportedPool, Liveness, PeerBackend};
use kvshard::pool::DevicePool;
use kvshard::transfer::{
    BackendTransport, ChunkEnd, ChunkStatus, DecodeRegistration, PendingChunk, PoolLayout, Sender,
};
use kvshard::{Error, Result};

use super::super::message::PromptTimes;
use super::super::{Role, REQUEST_TIMEOUT, STARTUP};
use super::dcp::{fetch_registrations, from_message, registration_socket};
use super::{decode_socket, PressurePdConfig};
use crate::demo::pressure::{Prompts, Scenario};
use crate::measure::{Laps, Moved};

/// One decode group as a prefill rank sends to it.
struct Group {
    /// Sends into the group's ranks' pools.
    sender: Sender,
    /// The group's registration of each prompt, until the prompt is opened.
    registrations: HashMap<u64, DecodeRegistration>,
}

/// A rank's sends into every decode group, each prompt chunk as soon as it is written.
pub(super) struct DcpSends {
    /// Each group's sender (dropped before the pools its launches write).
    groups: Vec<Group>,
    /// Chunks to report once they have landed, oldest first, with their group.
    landing: VecDeque<(usize, PendingChunk)>,
    /// The control channel to each decode process (decode rank `d` of group `g` is `g M + d`).
    channels: Vec<Channel>,
    /// Each decode process's pool, mapped here.
    pools: Vec<ImportedPool>,
    /// Decode ranks per group (M).
    m: usize,
    b: Arc<dyn Backend>,
    /// Each chunk's sends of the prompt being prefilled, on the rank's stream.
    laps: Laps,
    /// When the prompt's sends began and its last chunk was written.
    times: PromptTimes,
    /// Bytes of the prompt's chunks, to every decode rank of every group.
    bytes: u64,
}

/// What one decode process told a prefill rank before the first chunk: its pool, mapped, and
/// its registrations of its share of each prompt.
fn published(
    channel: &mut Channel,
    backend: &PeerBackend,
    pool: &DevicePool,
    prompts: usize,
) -> Result<(ImportedPool, Vec<Register>)> {
    let start = Instant::now();
    let (mut imported, mut registers) = (None, Vec::new());
    while imported.is_none() || registers.len() < prompts {
        let left = STARTUP.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(Error::Timeout {
                what: "a decode rank's pool and registrations".into(),
                waited: start.elapsed(),
            });
        }
        let Some(r) = channel.recv_timeout(left.min(Duration::from_millis(50)))? else {
            continue;
        };
        match r.message {
            wire::Message::PublishPool(p) => {
                let mapped = ImportedPool::import(backend, &p, r.fds)?;
                pool.geometry().validate_pd(mapped.geometry())?;
                imported = Some(mapped);
            }
            wire::Message::Register(register) => registers.push(register),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "a decode rank sent {} before the first chunk",
                    other.name()
                )))
            }
        }
    }
    let imported = imported.ok_or_else(|| Error::InvalidArgument("no pool published".into()))?;
    Ok((imported, registers))
}

/// Checks that what decode rank `d` registered with its own `Receiver` (`registers`) is its
/// share of `registration`: a status it takes is then of rows it expects.
fn check_share(registration: &DecodeRegistration, d: usize, registers: &[Register]) -> Result<()> {
    let share = &registration.ranks[d];
    let pages = |p: &[kvshard::index::LocalPage]| p.iter().map(|p| p.0).collect::<Vec<u64>>();
    let same = registers.iter().any(|r| {
        r.request == registration.request
            && r.prefix_pages == 0
            && r.pages == pages(&share.pages)
            && r.state_pages == pages(&share.state_pages)
    });
    if same {
        Ok(())
    } else {
        Err(Error::Transfer {
            request: registration.request,
            reason: format!(
                "decode rank {d} registered another share than its group's registration"
            ),
        })
    }
}

impl DcpSends {
    /// Prefill rank `rank` (its pool `pool` on `backend`): connects to every decode process of
    /// `cfg` (sockets from `socket`), maps their pools, and takes each group's registrations.
    pub(super) fn connect(
        cfg: &PressurePdConfig,
        socket: &Path,
        backend: &PeerBackend,
        pool: Arc<DevicePool>,
        rank: u32,
    ) -> Result<DcpSends> {
        let ranks = cfg.scenario.shape.ranks;
        let m = cfg.decode_layout.ranks();
        let mut channels = (0..cfg.processes.decodes)
            .map(|i| {
                let hello = Hello::new(wire::Role::Prefill, rank, ranks);
                Channel::connect(
                    decode_socket(socket, i),
                    hello,
                    Liveness::default(),
                    STARTUP,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let mut pools = Vec::with_capacity(channels.len());
        let mut registers = Vec::with_capacity(channels.len());
        for channel in &mut channels {
            let (mapped, r) = published(channel, backend, &pool, 2)?;
            pools.push(mapped);
            registers.push(r);
        }
        let mut groups = Vec::new();
        for g in 0..cfg.decode_groups() {
            let first = (g * m) as usize;
            let ranks_of = first..first + m as usize;
            let layouts: Vec<PoolLayout> =
                pools[ranks_of.clone()].iter().map(|p| p.layout()).collect();
            let messages = fetch_registrations(
                &registration_socket(socket, g),
                Role::Decode(g * m),
                2,
                STARTUP,
            )?;
            let mut registrations = HashMap::new();
            for message in &messages {
                let registration = from_message(message, &layouts)?;
                for d in 0..m as usize {
                    check_share(&registration, d, &registers[first + d])?;
                }
                registrations.insert(registration.request, registration);
            }
            let transport = BackendTransport::peer(backend.backend(), cfg.method)?;
            groups.push(Group {
                sender: Sender::new(pool.clone(), Box::new(transport)),
                registrations,
            });
        }
        Ok(DcpSends {
            groups,
            landing: VecDeque::new(),
            channels,
            pools,
            m: m as usize,
            b: backend.backend(),
            laps: Laps::default(),
            times: PromptTimes::default(),
            bytes: 0,
        })
    }

    /// Opens `request` in every group's sender, into its ranks' mapped pools.
    fn open(&mut self, request: u64) -> Result<()> {
        for (g, group) in self.groups.iter_mut().enumerate() {
            let registration =
                group
                    .registrations
                    .remove(&request)
                    .ok_or_else(|| Error::Transfer {
                        request,
                        reason: format!("decode group {g} never registered it"),
                    })?;
            let dsts = self.pools[g * self.m..(g + 1) * self.m]
                .iter()
                .map(|p| p.space().clone())
                .collect();
            group.sender.open_decode(registration, dsts)?;
        }
        Ok(())
    }

    /// Reports every chunk that has landed, oldest first, to each decode rank of its group with
    /// that rank's status; with `wait`, waits for each in turn first (blocks the host).
    fn report_landed(&mut self, wait: bool) -> Result<()> {
        while let Some((g, front)) = self.landing.front_mut() {
            let g = *g;
            let statuses = match front.poll_each() {
                Ok(Some(statuses)) => {
                    self.landing.pop_front();
                    statuses
                }
                Ok(None) if wait => match self.landing.pop_front() {
                    Some((_, pending)) => self.landed_or_failed(g, pending.wait_each_sync())?,
                    None => return Ok(()),
                },
                Ok(None) => return Ok(()),
                Err(e) => return self.landed_or_failed(g, Err(e)).map(|_| ()),
            };
            for (d, status) in statuses.into_iter().enumerate() {
                self.channels[g * self.m + d].send(&wire::Message::Chunk(status))?;
            }
        }
        Ok(())
    }

    /// The statuses of a chunk of group `g` that landed, or, for one that failed while moving,
    /// the failure told to every decode rank of the group, and the error.
    fn landed_or_failed(
        &mut self,
        g: usize,
        landed: Result<Vec<ChunkStatus>>,
    ) -> Result<Vec<ChunkStatus>> {
        let e = match landed {
            Ok(statuses) => return Ok(statuses),
            Err(e) => e,
        };
        if let Some(status) = ChunkStatus::from_error(&e) {
            for channel in &mut self.channels[g * self.m..(g + 1) * self.m] {
                let _ = channel.send(&wire::Message::Chunk(status.clone()));
            }
        }
        Err(e)
    }

    /// Reports what is left, then waits until every decode process has closed its channel
    /// (after it checked what landed); the pools are unmapped after the senders are gone.
    pub(super) fn wait_closed(mut self) -> Result<()> {
        self.report_landed(true)?;
        self.b.synchronize()?;
        let start = Instant::now();
        let mut open: Vec<bool> = vec![true; self.channels.len()];
        while open.iter().any(|&o| o) {
            if start.elapsed() > REQUEST_TIMEOUT {
                return Err(Error::Timeout {
                    what: "the decode ranks' end of the run".into(),
                    waited: start.elapsed(),
                });
            }
            for (i, channel) in self.channels.iter_mut().enumerate() {
                if !open[i] {
                    continue;
                }
                match channel.recv_timeout(Duration::from_millis(20)) {
                    Ok(None) => {}
                    Ok(Some(r)) if matches!(r.message, wire::Message::Abort { .. }) => {
                        return Err(Error::PeerGone {
                            rank: None,
                            why: format!("decode process {i} aborted a prompt"),
                        })
                    }
                    Ok(Some(r)) => open[i] = !matches!(r.message, wire::Message::Bye),
                    Err(_) => open[i] = false,
                }
            }
        }
        drop(self.groups);
        drop(self.pools);
        Ok(())
    }
}

impl Prompts for DcpSends {
    fn chunk_written(
        &mut self,
        _: &Scenario,
        request: u64,
        chain: &RequestChain,
        end: ChunkEnd,
    ) -> Result<()> {
        if !self.times.started() {
            self.open(request)?;
            self.bytes = 0;
            self.times.start();
        }
        if matches!(end, ChunkEnd::Final(_)) {
            self.b.synchronize()?;
            self.times.last_chunk_written();
        }
        let (groups, landing) = (&mut self.groups, &mut self.landing);
        let mut bytes = 0;
        self.laps.time(self.b.as_ref(), || {
            for (g, group) in groups.iter_mut().enumerate() {
                let pending = group.sender.send(request, chain.pages()?, end)?;
                bytes += pending.bytes().total();
                landing.push_back((g, pending));
            }
            Ok(())
        })?;
        self.bytes += bytes;
        self.report_landed(false)
    }

    fn prompt_done(
        &mut self,
        _: &Scenario,
        request: u64,
        _: &RequestChain,
        _: &RequestChain,
    ) -> Result<String> {
        self.b.synchronize()?;
        self.report_landed(true)?;
        let moved = Moved {
            bytes: self.bytes,
            ms: self.laps.total_ms_sync(self.b.as_ref())?,
        };
        self.times.emit_sent(request, moved);
        Ok(format!(
            "P/D sent to {} DCP{} decode groups as each chunk was written: {moved}",
            self.groups.len(),
            self.m
        ))
    }
}
