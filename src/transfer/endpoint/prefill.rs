//! The prefill side of P/D across processes: maps the decode's pools, sends every chunk of
//! every registered request into them, and reports each chunk's status in order.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::super::backend_transport::{BackendTransport, CallCounts};
use super::super::plan::Registration;
use super::super::ComponentBytes;
use super::super::{ChunkEnd, ChunkResult, ChunkStatus, PendingChunk, Sender};
use crate::copy::Method;
use crate::copy::RemoteSpace;
use crate::error::{Error, Result};
use crate::gpu::vmm::IpcEvent;
use crate::gpu::Stream;
use crate::index::{LocalPage, LogicalPage};
use crate::ipc::wire::Message;
use crate::ipc::wire::{Handle64, Hello, Register, Role};
use crate::ipc::{Channel, ImportedPool, Liveness};
use crate::ipc::{PeerBackend, Received};
use crate::pool::DevicePool;

use crate::lock::lock;

/// Interprocess events a GPU prefill rank shares: enough that the decode falling a few chunks
/// behind still waits for the chunk it asks about rather than a much later one.
pub const CHUNK_EVENTS: usize = 4;

/// A GPU rank's ring of interprocess events and the stream they are recorded on.
struct EventRing {
    events: Vec<IpcEvent>,
    next: usize,
    stream: Stream,
}

impl EventRing {
    /// Records the next event after everything enqueued so far.
    fn record(&mut self) -> Result<()> {
        let event = &self.events[self.next % self.events.len()];
        event.record(&self.stream)?;
        self.next += 1;
        Ok(())
    }
}

/// What happened on a prefill rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefillEvent {
    /// A decode pool was mapped: registrations may name it.
    PoolImported {
        /// The decode's id of the pool.
        pool: u64,
    },
    /// A published pool could not be mapped or does not fit this rank's cache; requests naming
    /// it fail at once.
    PoolRefused {
        /// The decode's id of the pool.
        pool: u64,
        /// Why.
        why: String,
    },
    /// A request was registered: send its chunks with [`PrefillEndpoint::send`].
    Registered {
        /// The request.
        request: u64,
    },
    /// A registration was refused (it does not validate, or names a pool that was not mapped);
    /// the decode was told.
    RegistrationRefused {
        /// The request.
        request: u64,
        /// Why.
        why: String,
    },
    /// The decode gave the request up; nothing more is sent for it. Its pages are the
    /// engine's to free.
    Aborted {
        /// The request.
        request: u64,
        /// The decode's reason.
        reason: String,
    },
    /// The endpoint is closed: the decode is gone (or a copy failed after it was reported). Every
    /// request it was sending is failed, its copies have landed and the pools are unmapped; the
    /// requests' pages are the engine's to free.
    Closed {
        /// Why.
        why: String,
        /// The requests it was sending, or had been registered.
        failed: Vec<u64>,
    },
}

/// The prefill side of cross-process P/D: one rank's connection to the decode, its mapped
/// decode pools and its sender (module docs: the protocol).
pub struct PrefillEndpoint {
    channel: Option<Channel>,
    backend: PeerBackend,
    pool: Arc<DevicePool>,
    method: Method,
    sender: Sender,
    stats: Arc<Mutex<CallCounts>>,
    /// What earlier transports of this endpoint submitted.
    stats_before: CallCounts,
    events: Option<EventRing>,
    pools: HashMap<u64, ImportedPool>,
    refused_pools: HashMap<u64, String>,
    /// Registered, not yet opened in the sender (the first send opens them).
    registered: HashMap<u64, (Registration, Arc<RemoteSpace>)>,
    open: HashSet<u64>,
    /// Chunks reported ahead of their copies (GPU), oldest first.
    inflight: VecDeque<PendingChunk>,
    /// Chunks to report once they have landed (the CPU twin: no event crosses processes, so the
    /// decode may hear of a chunk only after its bytes are in the shared pool), oldest first.
    landing: VecDeque<PendingChunk>,
    closed: Option<String>,
    backlog: Vec<PrefillEvent>,
    /// Aborts from the decode not answered yet: each is answered once no chunk of its request
    /// waits to be reported (an answer must follow every status of the request).
    aborts: Vec<(u64, String)>,
}

impl std::fmt::Debug for PrefillEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillEndpoint")
            .field("rank", &self.rank())
            .field("method", &self.method)
            .field("pools", &self.pools.len())
            .field("open", &self.open.len())
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl PrefillEndpoint {
    /// Connects rank `pool.rank()` of a group of `pool.placement().shard()` to the decode
    /// listening at `path` (retrying until it listens, within `timeout`), sending with
    /// `method` on `backend`, where `pool` lives. On a GPU it shares its interprocess events.
    pub fn connect(
        path: impl AsRef<Path>,
        backend: PeerBackend,
        pool: Arc<DevicePool>,
        method: Method,
        liveness: Liveness,
        timeout: Duration,
    ) -> Result<Self> {
        crate::backend::check_space(
            backend.address_space(),
            crate::copy::BlockSpace::address_space(pool.as_ref()),
            "the prefill pool",
        )?;
        let transport = BackendTransport::peer(backend.backend(), method)?;
        let hello = Hello::new(Role::Prefill, pool.rank(), pool.placement().shard());
        let mut channel = Channel::connect(path, hello, liveness, timeout)?;
        let events = match &backend {
            PeerBackend::Cpu(_) => None,
            PeerBackend::Cuda(cuda) => {
                let ctx = cuda.gpu().context();
                let events = (0..CHUNK_EVENTS)
                    .map(|_| IpcEvent::new(ctx))
                    .collect::<Result<Vec<_>>>()?;
                for e in &events {
                    channel.send(&Message::EventHandle {
                        handle: Handle64(e.handle()?),
                    })?;
                }
                Some(EventRing {
                    events,
                    next: 0,
                    stream: cuda.stream().clone(),
                })
            }
        };
        let stats = transport.calls();
        Ok(Self {
            channel: Some(channel),
            sender: Sender::new(pool.clone(), Box::new(transport)),
            backend,
            pool,
            method,
            stats,
            stats_before: CallCounts::default(),
            events,
            pools: HashMap::new(),
            refused_pools: HashMap::new(),
            registered: HashMap::new(),
            open: HashSet::new(),
            inflight: VecDeque::new(),
            landing: VecDeque::new(),
            closed: None,
            backlog: Vec::new(),
            aborts: Vec::new(),
        })
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.pool.rank()
    }

    /// This rank's pool.
    pub fn pool(&self) -> &Arc<DevicePool> {
        &self.pool
    }

    /// How chunks are moved.
    pub fn method(&self) -> Method {
        self.method
    }

    /// Moves later requests with `method`; refused while a request is being sent (between its
    /// first and its final chunk).
    pub fn set_method(&mut self, method: Method) -> Result<()> {
        if method == self.method {
            return Ok(());
        }
        if !self.open.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "the method cannot change while {} requests are being sent",
                self.open.len()
            )));
        }
        let transport = BackendTransport::peer(self.backend.backend(), method)?;
        self.replace_transport(transport);
        Ok(())
    }

    fn replace_transport(&mut self, transport: BackendTransport) {
        let method = transport.method();
        self.stats_before += *lock(&self.stats);
        self.stats = transport.calls();
        // The old transport's tables and the spaces its launches keep go with it (freeing
        // device memory waits for the device first).
        self.sender = Sender::new(self.pool.clone(), Box::new(transport));
        self.method = method;
    }

    /// What this rank has submitted so far.
    pub fn stats(&self) -> CallCounts {
        let mut all = self.stats_before;
        all += *lock(&self.stats);
        all
    }

    /// The registration of `request`, while it is registered and not finished here.
    pub fn registration(&self, request: u64) -> Option<&Registration> {
        self.registered.get(&request).map(|(r, _)| r)
    }

    /// Decode pools mapped into this process now.
    pub fn mapped_pools(&self) -> usize {
        self.pools.len()
    }

    /// Why the endpoint is closed (`None` while it is open).
    pub fn closed(&self) -> Option<&str> {
        self.closed.as_deref()
    }

    /// Blocks the host up to `timeout` (zero: not at all) for something to happen and returns
    /// what did: pools, registrations and aborts from the decode, or the end of the connection.
    /// Call it regularly: it also notices copies that failed after they were reported, and on
    /// the CPU twin reports the chunks that have landed (with a timeout, it first runs the
    /// copies still queued: they are this process's own work).
    pub fn poll_sync(&mut self, timeout: Duration) -> Result<Vec<PrefillEvent>> {
        let start = Instant::now();
        let mut out = std::mem::take(&mut self.backlog);
        self.report_landed(!timeout.is_zero())?;
        self.answer_aborts();
        loop {
            self.check_inflight();
            out.append(&mut self.backlog);
            let Some(channel) = self.channel.as_mut() else {
                return Ok(out);
            };
            let left = if out.is_empty() {
                timeout.saturating_sub(start.elapsed())
            } else {
                Duration::ZERO
            };
            match channel.recv_timeout(left) {
                Ok(Some(r)) => self.take(r),
                Ok(None) => return Ok(out),
                Err(e) => self.close(e.to_string()),
            }
            out.append(&mut self.backlog);
        }
    }

    /// Sends the next chunk of `request` (registered with this rank; the first send opens it):
    /// `src_pages` is the request's logical page of every sequence position prefilled so far.
    /// The chunk is reported to the decode: on the GPU as soon as it is enqueued, its event
    /// recorded; on the CPU twin once it has landed, by this or a later `send`, `poll_sync` or
    /// `bye_sync`. Nothing waits, on either. Returns the bytes it moves.
    ///
    /// A chunk that cannot be planned or enqueued fails the request on both sides and comes
    /// back as [`Error::ChunkFailed`]; a closed endpoint is [`Error::PeerGone`].
    pub fn send(
        &mut self,
        request: u64,
        src_pages: &[LogicalPage],
        end: ChunkEnd,
    ) -> Result<ComponentBytes> {
        if let Some(why) = &self.closed {
            return Err(Error::PeerGone {
                rank: Some(0),
                why: why.clone(),
            });
        }
        if let Some((registration, space)) = self.registered.remove(&request) {
            if let Err(e) = self.sender.open(registration, space) {
                let status = ChunkStatus {
                    request,
                    rank: self.rank(),
                    chunk: 0,
                    result: ChunkResult::Failed {
                        reason: e.to_string(),
                    },
                };
                self.report(status)?;
                return Err(Error::ChunkFailed {
                    request,
                    rank: self.rank(),
                    chunk: 0,
                    reason: e.to_string(),
                });
            }
            self.open.insert(request);
        }
        let last = matches!(end, ChunkEnd::Final(_));
        match self.sender.send(request, src_pages, end) {
            Ok(pending) => {
                let bytes = pending.bytes();
                if last {
                    self.open.remove(&request);
                }
                if self.events.is_some() {
                    let mut pending = pending;
                    let status = pending.reported();
                    self.inflight.push_back(pending);
                    self.report(status)?;
                } else {
                    self.landing.push_back(pending);
                    self.report_landed(false)?;
                }
                Ok(bytes)
            }
            Err(e) => Err(self.failed_chunk(request, e)),
        }
    }

    /// Reports a chunk that failed (the sender closed the request) and returns the error.
    fn failed_chunk(&mut self, request: u64, e: Error) -> Error {
        if self.open.remove(&request) {
            // A chunk that failed while moving leaves the request open in the sender; this
            // failure is its last status, reported below. (A chunk refused before it was
            // enqueued closed it already, which `close` then says.)
            let _ = self.sender.close(request);
        }
        if let Some(status) = ChunkStatus::from_error(&e) {
            if let Err(gone) = self.report(status) {
                return gone;
            }
        }
        e
    }

    /// Gives up `request` on this rank (the engine cancelled it): the decode is told with a
    /// failed status. Nothing is done for a request that is not registered here.
    pub fn abort(&mut self, request: u64, reason: &str) -> Result<()> {
        let status = if self.registered.remove(&request).is_some() {
            Some(ChunkStatus {
                request,
                rank: self.rank(),
                chunk: 0,
                result: ChunkResult::Failed {
                    reason: format!("aborted: {reason}"),
                },
            })
        } else if self.open.remove(&request) {
            self.sender.abort(request, reason).ok()
        } else {
            None
        };
        match status {
            Some(status) => self.report(status),
            None => Ok(()),
        }
    }

    /// Says goodbye to the decode and closes the connection, once this rank's reported copies
    /// have landed: blocks the host until the device has passed them.
    pub fn bye_sync(mut self) -> Result<()> {
        self.report_landed(true)?;
        self.drain_inflight();
        match self.channel.take() {
            Some(channel) => channel.bye(),
            None => Ok(()),
        }
    }

    /// Sends a status, after recording the event that covers it (GPU).
    fn report(&mut self, status: ChunkStatus) -> Result<()> {
        let sent = match (&mut self.channel, &mut self.events) {
            (None, _) => {
                return Err(Error::PeerGone {
                    rank: Some(0),
                    why: self.closed.clone().unwrap_or_default(),
                })
            }
            (Some(channel), events) => events
                .as_mut()
                .map_or(Ok(()), EventRing::record)
                .and_then(|()| channel.send(&Message::Chunk(status))),
        };
        if let Err(e) = &sent {
            self.close(e.to_string());
        }
        sent
    }

    /// Handles one message from the decode.
    fn take(&mut self, r: Received) {
        match r.message {
            Message::PublishPool(p) => {
                let id = p.pool;
                let imported = ImportedPool::import(&self.backend, &p, r.fds).and_then(|pool| {
                    self.pool.geometry().validate_pd(pool.geometry())?;
                    Ok(pool)
                });
                match imported {
                    Ok(pool) => {
                        self.refused_pools.remove(&id);
                        self.pools.insert(id, pool);
                        self.backlog.push(PrefillEvent::PoolImported { pool: id });
                    }
                    Err(e) => {
                        let why = e.to_string();
                        self.pools.remove(&id);
                        self.refused_pools.insert(id, why.clone());
                        self.backlog
                            .push(PrefillEvent::PoolRefused { pool: id, why });
                    }
                }
            }
            Message::Register(reg) => self.register(reg),
            Message::Abort { request, reason } => {
                if !self.aborts.iter().any(|(r, _)| *r == request) {
                    self.aborts.push((request, reason));
                }
                self.answer_aborts();
            }
            Message::Bye => self.close("the decode said Bye".into()),
            other => self.close(format!(
                "protocol violation: the decode sent {}",
                other.name()
            )),
        }
    }

    fn register(&mut self, reg: Register) {
        let request = reg.request;
        if self.registered.contains_key(&request) || self.open.contains(&request) {
            self.close(format!(
                "protocol violation: request {request} registered twice"
            ));
            return;
        }
        let checked = match self.pools.get(&reg.pool) {
            None => Err(match self.refused_pools.get(&reg.pool) {
                Some(why) => format!("pool {} was refused: {why}", reg.pool),
                None => format!("pool {} was never published", reg.pool),
            }),
            Some(pool) => crate::error::to_usize(reg.prefix_pages, || "a prefix".into())
                .and_then(|prefix_pages| {
                    let registration = Registration {
                        request,
                        layout: pool.layout(),
                        prefix_pages,
                        pages: reg.pages.iter().map(|&p| LocalPage(p)).collect(),
                        state_pages: reg.state_pages.iter().map(|&p| LocalPage(p)).collect(),
                    };
                    registration.validate()?;
                    Ok((registration, pool.space().clone()))
                })
                .map_err(|e| e.to_string()),
        };
        match checked {
            Ok(entry) => {
                self.registered.insert(request, entry);
                self.backlog.push(PrefillEvent::Registered { request });
            }
            Err(why) => {
                let status = ChunkStatus {
                    request,
                    rank: self.rank(),
                    chunk: 0,
                    result: ChunkResult::Failed {
                        reason: format!("registration refused: {why}"),
                    },
                };
                if self.report(status).is_ok() {
                    self.backlog
                        .push(PrefillEvent::RegistrationRefused { request, why });
                }
            }
        }
    }

    /// Answers each abort from the decode whose request has no chunk waiting to be reported:
    /// a request registered or being sent is aborted here (its failed status is the answer);
    /// one this rank is done with (its last status went out, or never reached the decode) is
    /// answered with an `Abort` back, which the decode takes as the rank's last status for it.
    fn answer_aborts(&mut self) {
        let mut i = 0;
        while i < self.aborts.len() {
            let request = self.aborts[i].0;
            if self.landing.iter().any(|p| p.request() == request) {
                i += 1;
                continue;
            }
            let (request, reason) = self.aborts.remove(i);
            let known = self.registered.contains_key(&request) || self.open.contains(&request);
            let answered = if known {
                self.abort(request, &reason)
            } else {
                let answer = Message::Abort {
                    request,
                    reason: format!("prefill rank {} is not sending it", self.rank()),
                };
                match self.channel.as_mut().map(|c| c.send(&answer)) {
                    Some(Err(e)) => {
                        self.close(e.to_string());
                        Err(Error::PeerGone {
                            rank: Some(0),
                            why: "the decode is gone".into(),
                        })
                    }
                    _ => Ok(()),
                }
            };
            if answered.is_ok() && known {
                self.backlog.push(PrefillEvent::Aborted { request, reason });
            }
        }
    }

    /// Drops chunks whose copies have landed; a copy that failed after it was reported closes
    /// the endpoint (its status is out already, and the device state is in doubt).
    fn check_inflight(&mut self) {
        while let Some(front) = self.inflight.front_mut() {
            match front.poll() {
                Ok(Some(_)) => {
                    self.inflight.pop_front();
                }
                Ok(None) => return,
                Err(e) => {
                    self.inflight.pop_front();
                    self.close(format!("a reported chunk failed on the device: {e}"));
                    return;
                }
            }
        }
    }

    /// Reports the CPU twin's chunks that have landed, oldest first; with `wait`, waits for
    /// each (they are this process's queued work) so that all are reported. A chunk that
    /// failed fails its request on both sides ([`Error::ChunkFailed`]).
    fn report_landed(&mut self, wait: bool) -> Result<()> {
        while let Some(front) = self.landing.front_mut() {
            let request = front.request();
            let landed = match front.poll() {
                Ok(None) if wait => match self.landing.pop_front() {
                    Some(pending) => pending.wait_sync().map(Some),
                    None => Ok(None),
                },
                Ok(None) => return Ok(()),
                polled => {
                    self.landing.pop_front();
                    polled
                }
            };
            match landed {
                Ok(Some(status)) => self.report(status)?,
                Ok(None) => return Ok(()),
                Err(e) => return Err(self.failed_chunk(request, e)),
            }
        }
        self.answer_aborts();
        Ok(())
    }

    /// Waits for every reported copy, and every copy not yet reported (errors are moot once the
    /// endpoint closes).
    fn drain_inflight(&mut self) {
        for pending in self.inflight.drain(..).chain(self.landing.drain(..)) {
            let _ = pending.wait_sync();
        }
    }

    /// Closes the endpoint: fails every request, waits for this rank's copies, unmaps the pools.
    fn close(&mut self, why: String) {
        if self.closed.is_some() {
            return;
        }
        let mut failed: Vec<u64> = self
            .open
            .drain()
            .chain(self.registered.drain().map(|(r, _)| r))
            .collect();
        failed.sort_unstable();
        for &request in &failed {
            let _ = self.sender.abort(request, &why);
        }
        self.drain_inflight();
        // A fresh transport drops the spaces the old one's launches kept; with the imported
        // pools gone, the mappings go (unmapping waits for this process's device work first).
        // The method was accepted when it was set, so a transport of it is always made.
        if let Ok(transport) = BackendTransport::peer(self.backend.backend(), self.method) {
            self.replace_transport(transport);
        }
        self.pools.clear();
        self.channel = None;
        self.aborts.clear();
        self.closed = Some(why.clone());
        self.backlog.push(PrefillEvent::Closed { why, failed });
    }
}
