//! The decode side of P/D across processes: publishes pools and registrations, takes every
//! rank's chunk statuses (after their copies have landed), and fails what a gone rank leaves.

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::plan::{PoolLayout, Registration};
use super::super::{ChunkResult, ChunkStatus, Finished, Overdue, Receiver};
use crate::error::{Error, Result};
use crate::gpu::vmm::IpcEvent;
use crate::ipc::proc_stat;
use crate::ipc::wire::Message;
use crate::ipc::wire::{self, Handle64, Hello, Register, Role};
use crate::ipc::{recv_any, Channel, ExportedPool, Listener, Liveness};
use crate::ipc::{PeerBackend, Received};

/// Longest a [`DecodeEndpoint::poll_sync`] sleeps between looks at what its socket poll cannot
/// see: new connections, events of chunks reported ahead of their copies, exits of gone ranks,
/// deadlines passing.
const LOOK_AGAIN: Duration = Duration::from_millis(20);
/// The same while a status waits for its event.
const LOOK_AGAIN_EVENTS: Duration = Duration::from_micros(50);

/// A process on the other end of a connection, as far as telling that it has exited goes.
#[derive(Debug, Clone)]
struct Process {
    /// From `SO_PEERCRED`; `None` when the peer is in another PID namespace.
    pid: Option<i32>,
    /// Its start time (`/proc/<pid>/stat` field 22), so a reused PID is not mistaken for it.
    start: Option<u64>,
    /// When it was found gone: a process of unknown PID is given one liveness timeout more.
    gone_at: Option<Instant>,
}

impl Process {
    fn of(channel: &Channel) -> Self {
        let pid = rustix::net::sockopt::socket_peercred(channel)
            .ok()
            .map(|c| c.pid.as_raw_nonzero().get())
            .filter(|&p| p > 0);
        let start = pid.and_then(proc_stat).and_then(|(_, s)| s);
        Process {
            pid,
            start,
            gone_at: None,
        }
    }

    /// Whether the process can no longer touch anything: exited (a zombie has released its
    /// memory and devices) or replaced by another process of the same PID.
    fn exited(&self, grace: Duration) -> bool {
        match self.pid {
            Some(pid) => match proc_stat(pid) {
                None => true,
                Some((state, start)) => matches!(state, 'Z' | 'X') || start != self.start,
            },
            None => self.gone_at.is_none_or(|at| at.elapsed() >= grace),
        }
    }
}

/// What a rank reported that the decode takes once its copy has landed.
#[derive(Debug)]
enum Waiting {
    /// A `Chunk` status, covered by event `slot` of the rank's ring (`None`: already landed).
    Status(ChunkStatus, Option<usize>),
    /// The rank gave the request up (`Abort` from a prefill): its next status is a failure.
    Abort { request: u64, reason: String },
}

/// One connected prefill rank.
struct RankLink {
    rank: u32,
    process: Process,
    /// Its interprocess events, in the order their handles came.
    events: Vec<IpcEvent>,
    /// `Chunk`s seen so far: the next one is covered by event `covered mod E`.
    covered: u64,
    waiting: VecDeque<Waiting>,
}

/// A request the decode side has registered and not yet handed back.
#[derive(Debug)]
struct Open {
    /// Per rank: the next chunk expected, and whether its last status is in.
    next_chunk: Vec<u32>,
    done: Vec<bool>,
    /// Processes of ranks that vanished while the request was open.
    gone: Vec<Process>,
}

/// What happened on the decode side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeEvent {
    /// Prefill rank `rank` connected and was sent every published pool.
    Joined {
        /// The rank.
        rank: u32,
    },
    /// A connection was refused (wrong role or shard, a rank already connected, a failed
    /// handshake or publication).
    Refused {
        /// Why.
        why: String,
    },
    /// A request is done: every rank has reported its last status, and on failure no rank can
    /// still write its pages. They are the caller's again.
    Finished(Box<Finished>),
    /// Prefill rank `rank` is gone (exited, killed, silent, or broke the protocol); the
    /// requests it was sending are failed (and handed back as they finish).
    RankGone {
        /// The rank.
        rank: u32,
        /// How it was noticed.
        why: String,
        /// Requests it had not finished.
        failed: Vec<u64>,
    },
    /// A request's deadline passed before every rank had reported its last status (the
    /// [`Error::TransferDeadline`] it converts into): it is failed, the ranks named were told
    /// to abort it, and it is handed back ([`DecodeEvent::Finished`]) once they have answered,
    /// or are gone and have exited.
    Overdue(Overdue),
}

/// The decode side of cross-process P/D: publishes pools, registers requests with every prefill
/// rank of the group, and tracks their chunk statuses (module docs: the protocol).
pub struct DecodeEndpoint {
    listener: Listener,
    backend: PeerBackend,
    shard: u32,
    liveness: Liveness,
    /// Connected ranks: channels (as [`recv_any`] takes them) and their state, index-aligned.
    channels: Vec<Channel>,
    links: Vec<RankLink>,
    pools: Vec<(u64, Arc<ExportedPool>)>,
    next_pool: u64,
    receiver: Receiver,
    requests: HashMap<u64, Open>,
    /// Failed requests waiting for gone ranks' processes to exit.
    held: Vec<(Finished, Vec<Process>)>,
    backlog: Vec<DecodeEvent>,
    /// Statuses dropped: repeats, and those of requests no longer open.
    dropped: u64,
}

impl std::fmt::Debug for DecodeEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeEndpoint")
            .field("path", &self.listener.path())
            .field("shard", &self.shard)
            .field("ranks", &self.connected_ranks())
            .field("requests", &self.requests.len())
            .finish_non_exhaustive()
    }
}

impl DecodeEndpoint {
    /// Listens at `path` for the `shard` ranks of a prefill group, pools on `backend`.
    pub fn bind(
        path: impl AsRef<Path>,
        backend: PeerBackend,
        shard: u32,
        liveness: Liveness,
    ) -> Result<Self> {
        if shard == 0 || shard > super::super::MAX_PREFILL_RANKS {
            return Err(Error::InvalidArgument(format!(
                "a prefill group of {shard} ranks (1 to {})",
                super::super::MAX_PREFILL_RANKS
            )));
        }
        let listener = Listener::bind(path, Hello::new(Role::Decode, 0, 1), liveness)?;
        Ok(Self {
            listener,
            backend,
            shard,
            liveness,
            channels: Vec::new(),
            links: Vec::new(),
            pools: Vec::new(),
            next_pool: 1,
            receiver: Receiver::new(),
            requests: HashMap::new(),
            held: Vec::new(),
            backlog: Vec::new(),
            dropped: 0,
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        self.listener.path()
    }

    /// The prefill group's size N.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// Ranks connected now, in rank order.
    pub fn connected_ranks(&self) -> Vec<u32> {
        let mut ranks: Vec<u32> = self.links.iter().map(|l| l.rank).collect();
        ranks.sort_unstable();
        ranks
    }

    /// How long a request may take, from its registration to every rank's last status, before
    /// it is reported [`DecodeEvent::Overdue`].
    pub fn deadline(&self) -> Duration {
        self.receiver.deadline()
    }

    /// Sets the deadline of requests registered from now on (module docs: deadlines).
    pub fn set_deadline(&mut self, deadline: Duration) {
        self.receiver.set_deadline(deadline);
    }

    /// Blocks the host up to `timeout` until every rank of the group is connected; what
    /// happened meanwhile is kept for the next [`DecodeEndpoint::poll_sync`].
    pub fn wait_for_ranks_sync(&mut self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        while self.links.len() < self.shard as usize {
            let elapsed = start.elapsed();
            if elapsed >= timeout {
                return Err(Error::Timeout {
                    what: format!(
                        "{} of {} prefill ranks connected to {}",
                        self.links.len(),
                        self.shard,
                        self.listener.path().display()
                    ),
                    waited: elapsed,
                });
            }
            let mut events = Vec::new();
            self.step((timeout - elapsed).min(LOOK_AGAIN), &mut events)?;
            self.backlog.extend(events);
        }
        Ok(())
    }

    /// Publishes `pool` (in this endpoint's backend) to every rank, now and as they join;
    /// returns its id, which registrations name.
    pub fn publish(&mut self, pool: Arc<ExportedPool>) -> Result<u64> {
        crate::backend::check_space(
            self.backend.address_space(),
            crate::copy::BlockSpace::address_space(pool.pool().as_ref()),
            "the published pool",
        )?;
        let id = self.next_pool;
        // Checked once here, so a pool that cannot be described fails the call, not a join.
        pool.publication(id)?;
        self.next_pool += 1;
        self.pools.push((id, pool));
        for rank in self.connected_ranks() {
            if let Some(i) = self.link_of(rank) {
                if let Err(e) = self.publish_to(i, id) {
                    self.rank_gone(i, e.to_string());
                }
            }
        }
        Ok(id)
    }

    /// The index of `rank`'s link, while it is connected.
    fn link_of(&self, rank: u32) -> Option<usize> {
        self.links.iter().position(|l| l.rank == rank)
    }

    /// Sends `msg` to each of `ranks` still connected; a rank the send fails for is gone.
    /// Ranks are looked up one by one: a rank going meanwhile moves the others' links.
    fn send_to(&mut self, ranks: &[u32], msg: &Message) {
        for &rank in ranks {
            let Some(i) = self.link_of(rank) else {
                continue;
            };
            if let Err(e) = self.channels[i].send(msg) {
                self.rank_gone(i, e.to_string());
            }
        }
    }

    fn publish_to(&mut self, i: usize, id: u64) -> Result<()> {
        let Some((_, pool)) = self.pools.iter().find(|(p, _)| *p == id) else {
            return Ok(());
        };
        let (msg, fds) = pool.publication(id)?;
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        self.channels[i].send_with_fds(&msg, &borrowed)
    }

    /// Registers a request with every rank of the group: its pages of pool `pool` (an id from
    /// [`DecodeEndpoint::publish`]) are written by the ranks from now on, within
    /// [`DecodeEndpoint::deadline`] from now. Refused, changing
    /// nothing, when the registration does not validate, does not describe the pool, or a rank
    /// is not connected.
    pub fn register(&mut self, pool: u64, registration: Registration) -> Result<()> {
        let request = registration.request;
        let Some((_, exported)) = self.pools.iter().find(|(p, _)| *p == pool) else {
            return Err(Error::Transfer {
                request,
                reason: format!("pool {pool} was never published"),
            });
        };
        if registration.layout != PoolLayout::of(exported.pool()) {
            return Err(Error::Transfer {
                request,
                reason: format!("the registration does not describe published pool {pool}"),
            });
        }
        if let Some(missing) = (0..self.shard).find(|r| !self.links.iter().any(|l| l.rank == *r)) {
            return Err(Error::Transfer {
                request,
                reason: format!("prefill rank {missing} is not connected"),
            });
        }
        let msg = Message::Register(Register {
            request,
            pool,
            prefix_pages: registration.prefix_pages as u64,
            pages: registration.pages.iter().map(|p| p.0).collect(),
            state_pages: registration.state_pages.iter().map(|p| p.0).collect(),
        });
        // Encoded before anything changes, so a registration too large for a frame is refused.
        wire::encode(&msg, 0).map_err(|e| Error::Transfer {
            request,
            reason: format!("cannot be sent: {e}"),
        })?;
        self.receiver.register(registration, self.shard)?;
        let n = self.shard as usize;
        self.requests.insert(
            request,
            Open {
                next_chunk: vec![0; n],
                done: vec![false; n],
                gone: Vec::new(),
            },
        );
        self.send_to(&self.connected_ranks(), &msg);
        Ok(())
    }

    /// Gives up `request`: every rank still sending it is told to abort and answers with a
    /// failed status; the request is handed back failed once all have.
    pub fn abort(&mut self, request: u64, reason: &str) -> Result<()> {
        let Some(open) = self.requests.get(&request) else {
            return Err(Error::Transfer {
                request,
                reason: "cannot abort: not registered (unknown, or already finished)".into(),
            });
        };
        let msg = Message::Abort {
            request,
            reason: reason.to_string(),
        };
        let targets: Vec<u32> = self
            .links
            .iter()
            .map(|l| l.rank)
            .filter(|&r| !open.done[r as usize])
            .collect();
        self.send_to(&targets, &msg);
        Ok(())
    }

    /// Per rank, the chunks of `request` that have landed (`None` once it is handed back).
    pub fn chunks_landed(&self, request: u64) -> Option<Vec<u32>> {
        self.requests.get(&request).map(|o| o.next_chunk.clone())
    }

    /// Requests registered and not yet handed back.
    pub fn pending_requests(&self) -> usize {
        self.requests.len() + self.held.len()
    }

    /// Statuses dropped so far: repeats of a chunk already taken, and statuses of requests no
    /// longer open (a rank's late answer to a request that failed).
    pub fn dropped_statuses(&self) -> u64 {
        self.dropped
    }

    /// Blocks the host up to `timeout` (zero: not at all) for something to happen and returns
    /// what did (empty when nothing did): ranks joining or going, requests finishing or overdue.
    /// Call it regularly: it also accepts connections, takes statuses whose copies have landed,
    /// notices silent ranks and passed deadlines.
    pub fn poll_sync(&mut self, timeout: Duration) -> Result<Vec<DecodeEvent>> {
        let start = Instant::now();
        let mut out = std::mem::take(&mut self.backlog);
        self.step(Duration::ZERO, &mut out)?;
        while out.is_empty() {
            let elapsed = start.elapsed();
            if elapsed >= timeout {
                break;
            }
            let left = timeout - elapsed;
            if self.links.iter().any(|l| !l.waiting.is_empty()) {
                // A copy is about to land and only its event will say so: look again soon (a
                // socket poll would round the wait up to a millisecond).
                std::thread::sleep(left.min(LOOK_AGAIN_EVENTS));
                self.step(Duration::ZERO, &mut out)?;
            } else {
                self.step(left.min(LOOK_AGAIN), &mut out)?;
            }
        }
        Ok(out)
    }

    /// One round: accepts waiting connections, takes messages (waiting up to `wait` for the
    /// first), takes statuses whose copies landed, reports overdue requests, hands back held
    /// requests whose gone ranks have exited.
    fn step(&mut self, wait: Duration, out: &mut Vec<DecodeEvent>) -> Result<()> {
        self.accept_pending(out);
        self.receive_ready(wait, out)?;
        self.release_landed(out)?;
        self.expire(out);
        self.release_held(out);
        Ok(())
    }

    /// Reports every request whose deadline passed (statuses that landed counted first) and
    /// tells the ranks it misses to abort it: each answers with a failed status, which hands
    /// the request back once every rank has.
    fn expire(&mut self, out: &mut Vec<DecodeEvent>) {
        for overdue in self.receiver.expire() {
            let reason = format!(
                "the decode's deadline of {:?} for it passed",
                overdue.deadline
            );
            // Registered here as long as the receiver tracks it, so the abort cannot fail.
            let _ = self.abort(overdue.request, &reason);
            out.push(DecodeEvent::Overdue(overdue));
            out.append(&mut self.backlog);
        }
    }

    /// Accepts every connection waiting now.
    fn accept_pending(&mut self, out: &mut Vec<DecodeEvent>) {
        loop {
            let channel = match self.listener.accept_timeout(Duration::ZERO) {
                Ok(Some(ch)) => ch,
                Ok(None) => return,
                Err(e) => {
                    out.push(DecodeEvent::Refused { why: e.to_string() });
                    continue;
                }
            };
            let peer = channel.peer().clone();
            let why = if peer.role != Role::Prefill {
                Some("a decode peer connected to a decode endpoint".to_string())
            } else if peer.shard != self.shard {
                Some(format!(
                    "rank {} of a group of {}, this decode serves a group of {}",
                    peer.rank, peer.shard, self.shard
                ))
            } else if peer.rank >= self.shard {
                Some(format!("rank {} of a group of {}", peer.rank, self.shard))
            } else if self.links.iter().any(|l| l.rank == peer.rank) {
                Some(format!("rank {} is connected already", peer.rank))
            } else {
                None
            };
            if let Some(why) = why {
                out.push(DecodeEvent::Refused { why });
                continue;
            }
            self.links.push(RankLink {
                rank: peer.rank,
                process: Process::of(&channel),
                events: Vec::new(),
                covered: 0,
                waiting: VecDeque::new(),
            });
            self.channels.push(channel);
            let i = self.channels.len() - 1;
            let ids: Vec<u64> = self.pools.iter().map(|(id, _)| *id).collect();
            let published = ids.into_iter().try_for_each(|id| self.publish_to(i, id));
            match published {
                Ok(()) => out.push(DecodeEvent::Joined { rank: peer.rank }),
                Err(e) => {
                    self.drop_link(i);
                    out.push(DecodeEvent::Refused {
                        why: format!("rank {}: publishing the pools failed: {e}", peer.rank),
                    });
                }
            }
        }
    }

    /// Takes messages until none comes within `wait` (zero: only those already there).
    fn receive_ready(&mut self, wait: Duration, out: &mut Vec<DecodeEvent>) -> Result<()> {
        let mut wait = wait;
        loop {
            let Some((i, received)) = recv_any(&mut self.channels, wait)? else {
                return Ok(());
            };
            wait = Duration::ZERO;
            match received {
                Ok(r) => {
                    if let Err(why) = self.take(i, r) {
                        self.rank_gone(i, why);
                    }
                }
                Err(e) => self.rank_gone(i, e.to_string()),
            }
            out.append(&mut self.backlog);
        }
    }

    /// Handles one message of link `i`; an error is a protocol violation that ends the link.
    fn take(&mut self, i: usize, r: Received) -> std::result::Result<(), String> {
        let rank = self.links[i].rank;
        match r.message {
            Message::Chunk(status) => {
                if status.rank != rank {
                    return Err(format!(
                        "protocol violation: rank {rank} reported a chunk of rank {}",
                        status.rank
                    ));
                }
                let link = &mut self.links[i];
                let slot = (!link.events.is_empty())
                    .then(|| (link.covered % link.events.len() as u64) as usize);
                // Counted even when dropped: the rank recorded an event for it.
                link.covered += 1;
                if !self.requests.contains_key(&status.request) {
                    // Of a request this side is done with (a late or repeated status): nothing
                    // to take, nothing held.
                    self.dropped += 1;
                    return Ok(());
                }
                link.waiting.push_back(Waiting::Status(status, slot));
                Ok(())
            }
            Message::EventHandle { handle } => self.open_event(i, handle),
            Message::Abort { request, reason } => {
                if self.requests.contains_key(&request) {
                    self.links[i]
                        .waiting
                        .push_back(Waiting::Abort { request, reason });
                }
                Ok(())
            }
            Message::Bye => Err("said Bye".into()),
            other => Err(format!(
                "protocol violation: a prefill rank sent {}",
                other.name()
            )),
        }
    }

    fn open_event(&mut self, i: usize, handle: Handle64) -> std::result::Result<(), String> {
        let link = &mut self.links[i];
        if link.covered > 0 {
            return Err("protocol violation: an event handle after its first Chunk".into());
        }
        let PeerBackend::Cuda(cuda) = &self.backend else {
            return Err("sent an interprocess event, but this decode runs on the CPU".into());
        };
        let event = IpcEvent::open(cuda.gpu().context(), &handle.0)
            .map_err(|e| format!("cannot open its interprocess event: {e}"))?;
        link.events.push(event);
        Ok(())
    }

    /// Takes, rank by rank and in order, every status whose copy has landed.
    fn release_landed(&mut self, out: &mut Vec<DecodeEvent>) -> Result<()> {
        let mut i = 0;
        while i < self.links.len() {
            let mut broken = None;
            loop {
                let link = &mut self.links[i];
                let ready = match link.waiting.front() {
                    None => break,
                    Some(Waiting::Status(_, Some(slot))) => match link.events[*slot].query() {
                        Ok(ready) => ready,
                        Err(e) => {
                            broken = Some(format!("its interprocess event failed: {e}"));
                            break;
                        }
                    },
                    Some(_) => true,
                };
                if !ready {
                    break;
                }
                let Some(front) = link.waiting.pop_front() else {
                    break;
                };
                let rank = link.rank;
                let status = match front {
                    Waiting::Status(status, _) => status,
                    Waiting::Abort { request, reason } => {
                        let Some(open) = self.requests.get(&request) else {
                            continue;
                        };
                        if open.done[rank as usize] {
                            continue;
                        }
                        ChunkStatus {
                            request,
                            rank,
                            chunk: open.next_chunk[rank as usize],
                            result: ChunkResult::Failed {
                                reason: format!("aborted by the prefill rank: {reason}"),
                            },
                        }
                    }
                };
                if let Err(e) = self.feed(status, out) {
                    broken = Some(format!("protocol violation: {e}"));
                    break;
                }
            }
            match broken {
                Some(why) => self.rank_gone(i, why),
                None => i += 1,
            }
        }
        out.append(&mut self.backlog);
        Ok(())
    }

    /// Gives one status to the receiver; a finished request is handed back, or held while a gone
    /// rank's process may still write its pages. A status of a chunk already taken (a repeat),
    /// or of a request no longer open, is dropped and counted.
    fn feed(&mut self, status: ChunkStatus, out: &mut Vec<DecodeEvent>) -> Result<()> {
        let (request, rank, terminal) =
            (status.request, status.rank as usize, status.is_terminal());
        let repeat = self.requests.get(&request).is_none_or(|o| {
            o.done.get(rank).is_none_or(|&done| done)
                || o.next_chunk
                    .get(rank)
                    .is_some_and(|&next| status.chunk < next)
        });
        if repeat {
            self.dropped += 1;
            return Ok(());
        }
        let finished = self.receiver.receive(status)?;
        if let Some(open) = self.requests.get_mut(&request) {
            open.next_chunk[rank] += 1;
            open.done[rank] = terminal;
        }
        if let Some(finished) = finished {
            let gone = self
                .requests
                .remove(&request)
                .map(|o| o.gone)
                .unwrap_or_default();
            self.hand_back(finished, gone, out);
        }
        Ok(())
    }

    fn hand_back(&mut self, finished: Finished, gone: Vec<Process>, out: &mut Vec<DecodeEvent>) {
        let grace = self.liveness.timeout;
        if gone.iter().all(|p| p.exited(grace)) {
            out.push(DecodeEvent::Finished(Box::new(finished)));
        } else {
            self.held.push((finished, gone));
        }
    }

    fn release_held(&mut self, out: &mut Vec<DecodeEvent>) {
        let grace = self.liveness.timeout;
        let mut i = 0;
        while i < self.held.len() {
            if self.held[i].1.iter().all(|p| p.exited(grace)) {
                out.push(DecodeEvent::Finished(Box::new(self.held.remove(i).0)));
            } else {
                i += 1;
            }
        }
    }

    fn drop_link(&mut self, i: usize) -> RankLink {
        // Dropping the channel shuts the socket down: the peer sees the end at once.
        drop(self.channels.swap_remove(i));
        self.links.swap_remove(i)
    }

    /// Link `i` is gone: fails every open request it had not finished (telling the other ranks
    /// to abort them) and reports it.
    fn rank_gone(&mut self, i: usize, why: String) {
        let mut link = self.drop_link(i);
        link.process.gone_at = Some(Instant::now());
        let rank = link.rank;
        let mut failed: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, o)| !o.done[rank as usize])
            .map(|(&r, _)| r)
            .collect();
        failed.sort_unstable();
        let mut out = Vec::new();
        for &request in &failed {
            let Some(open) = self.requests.get_mut(&request) else {
                continue;
            };
            open.gone.push(link.process.clone());
            let status = ChunkStatus {
                request,
                rank,
                chunk: open.next_chunk[rank as usize],
                result: ChunkResult::Failed {
                    reason: format!("prefill rank {rank} gone: {why}"),
                },
            };
            // The receiver expects exactly this status (the rank's next, not yet done), so it
            // cannot refuse it.
            let _ = self.feed(status, &mut out);
            if self.requests.contains_key(&request) {
                let _ = self.abort(request, &format!("prefill rank {rank} is gone"));
            }
        }
        self.backlog
            .push(DecodeEvent::RankGone { rank, why, failed });
        self.backlog.extend(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_process_has_not_exited_and_an_unknown_one_gets_a_grace() {
        let me = Process {
            pid: i32::try_from(std::process::id()).ok(),
            start: proc_stat(std::process::id() as i32).and_then(|(_, s)| s),
            gone_at: None,
        };
        assert!(!me.exited(Duration::ZERO));
        let reused = Process {
            start: me.start.map(|s| s + 1),
            ..me.clone()
        };
        assert!(
            reused.exited(Duration::ZERO),
            "another process under the same PID"
        );
        let unknown = Process {
            pid: None,
            start: None,
            gone_at: Some(Instant::now()),
        };
        assert!(!unknown.exited(Duration::from_secs(60)));
        assert!(unknown.exited(Duration::ZERO));
    }
}
