//! The HiCache controller of one rank: a load stream and a backup stream between the device pool
//! and the host pool, the host allocator, write policies and FIFO acks.
//!
//! Every rank of a shard group makes the same calls with the same logical pages (the radix tree
//! and the allocators are replicated), so every rank hands out the same queue indices, the same
//! host pages and the same acks, including a rank that owns none of an operation's pages: its
//! operation moves nothing but is submitted, signalled and acked like the others.
//!
//! - Backups (D2H) wait for an event of the compute stream, so they never race the forward pass
//!   writing the pages, copy every layer, and are acked strictly in submission order, only once
//!   complete. [`HiCacheController::poll_backups`] counts the acks ready now: a shard group
//!   agrees on the minimum over its ranks and each rank then pops exactly that many with
//!   [`HiCacheController::ack_backups_sync`], so ack counts stay in step.
//! - Loads (H2D) return a [`LoadHandle`] whose per-layer readiness a consumer waits on layer by
//!   layer: on the SM kernel, one launch with a ready counter per layer; on the copy-engine
//!   backends, the layer's copies followed by an event, layer after layer; through the staging
//!   ([`Route::Staged`]), every layer at once, so each layer is ready when the whole load is.
//! - Every operation takes a [`Route`]: straight between the pools with a [`Method`], or
//!   through the controller's device staging ([`HostTransfer::run_staged`]: the copy engine
//!   moves large host runs, a relayout places the pages), which BENCHMARKS.md measured best for
//!   bulk transfers next to compute. The staging of each direction is made on its first staged
//!   transfer and kept; the relayouts run on the direction's relayout stream ([`Streams`]).
//! - Write policies decide when a node is backed up: on its first access (write-through), its
//!   second (write-through-selective), or only when it is evicted from the device, blocking
//!   until the copy is done (write-back).
//!
//! Host pages come from a [`ShardAllocator`] over the host pool: a node with a shard owner gets
//! host pages along its owner rotation; a node without one gets pages of the same owner classes
//! as its device pages. Device pages are the engine's: the controller never allocates or frees
//! them, and after [`HiCacheController::evict_sync`] returns the engine frees (or reuses) the
//! node's device pages itself.
//!
//! The controller holds its pools and streams (`Arc`s), so an engine keeps one per rank with no
//! lifetimes attached. Every error path leaves the controller as it was: a backup that fails
//! returns its host pages (after the backup stream has passed whatever it enqueued).

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::Arc;

use super::acks::{BackupAck, HiCacheStep, LoadAck, LoadHandle, Pending};
use super::direct::HostTransfer;
use super::layer_ready::LayerReady;
use super::route::{check_route, unresolved, Route};
use super::staged::StagedIo;
use super::transfer_plan::TransferPlan;
use crate::backend::{Backend, Event};
use crate::chain::RequestChain;
use crate::copy::{BlockSpace, Direction, LayerSignals, Layers, Method, TableBuffer};
use crate::error::{Error, Result};
use crate::index::{LogicalPage, ModelLayer};
use crate::pool::host::HostPool;
use crate::pool::DevicePool;
use crate::shard::{AllocRequest, ChainStart, ShardAllocator};

/// Kernel-table buffers kept for reuse once their transfer is acked: allocating and freeing
/// device memory per transfer would serialize the device's streams.
const SPARE_TABLES: usize = 8;

/// Pages each of a direction's two staging buffers holds unless
/// [`HiCacheController::set_staging_pages`] says otherwise: the chunk that measured best for the
/// kernel relayout at 64 and 512 pages (run of 2026-12-02 at 48e7311: the two buffers overlap as
/// soon as a load has more than one chunk). Device memory: `2 * pages * page bytes` per
/// direction in use.
pub const DEFAULT_STAGING_PAGES: u64 = 16;

/// When a device node is backed up to the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WritePolicy {
    /// On the node's first access.
    WriteThrough,
    /// On the node's second access (hit count >= 2).
    WriteThroughSelective,
    /// Only when the node is evicted from the device pool; eviction waits for the copy.
    WriteBack,
}

impl WritePolicy {
    /// Accesses after which a node is backed up; `None` when only eviction backs it up.
    pub fn access_threshold(self) -> Option<u32> {
        match self {
            Self::WriteThrough => Some(1),
            Self::WriteThroughSelective => Some(2),
            Self::WriteBack => None,
        }
    }
}

/// The streams a controller enqueues on: loads, backups, the relayouts of staged loads and
/// backups ([`Route::Staged`]), and the uploads of kernel tables (kept off the others because an
/// upload waits for its stream). Five streams of one device (CUDA: a `CudaBackend::new` each;
/// CPU: `CpuBackend::new_stream` of one backend).
#[derive(Clone)]
pub struct Streams {
    /// Host to device; a load has landed when this stream reaches its completion event.
    pub load: Arc<dyn Backend>,
    /// Device to host; a backup has landed when this stream reaches its completion event.
    pub backup: Arc<dyn Backend>,
    /// Staged loads' relayouts from the staging into the device pool.
    pub load_relayout: Arc<dyn Backend>,
    /// Staged backups' relayouts from the device pool into the staging.
    pub backup_relayout: Arc<dyn Backend>,
    /// Kernel-table uploads.
    pub tables: Arc<dyn Backend>,
}

impl Streams {
    /// Five streams, each made by `stream` in turn (load, backup, the two relayouts, tables).
    pub fn each(mut stream: impl FnMut() -> Result<Arc<dyn Backend>>) -> Result<Self> {
        Ok(Self {
            load: stream()?,
            backup: stream()?,
            load_relayout: stream()?,
            backup_relayout: stream()?,
            tables: stream()?,
        })
    }
}

impl Streams {
    /// Every stream, the same one as often as it is given.
    pub(super) fn all(&self) -> [&Arc<dyn Backend>; 5] {
        [
            &self.load,
            &self.backup,
            &self.load_relayout,
            &self.backup_relayout,
            &self.tables,
        ]
    }
}

impl std::fmt::Debug for Streams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streams")
            .field("backend", &self.load.name())
            .finish_non_exhaustive()
    }
}

/// A radix-tree node as the controller sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheNode {
    /// Node id (unique while the node is cached anywhere).
    pub id: u64,
    /// Logical device pages of the node, in chain order.
    pub device_pages: Vec<LogicalPage>,
    /// The chain's owner at the node's first page, when the node has a shard owner. Owner 0 is
    /// an owner: only `None` means "no shard owner".
    pub start_owner: Option<u32>,
}

impl CacheNode {
    /// The node of positions `pages` of `chain`, with id `id`. It has a shard owner (the owner
    /// of its first page) only when the cache is sharded. Refused for a range past the chain's
    /// end or a stale chain ([`RequestChain::pages_at`]).
    pub fn of_chain(chain: &RequestChain, id: u64, pages: Range<usize>) -> Result<Self> {
        let start = pages.start;
        let device_pages = chain.pages_at(pages)?.to_vec();
        let start_owner = if chain.placement().shard() > 1 {
            chain.owner_at(start)
        } else {
            None
        };
        Ok(CacheNode {
            id,
            device_pages,
            start_owner,
        })
    }

    /// Allocates the host pages a backup of this node gets from the host allocator: along the
    /// node's owner rotation when it has a shard owner, else of the same owner classes as its
    /// device pages. All or nothing.
    pub fn alloc_host_pages(&self, host: &mut ShardAllocator) -> Result<Vec<LogicalPage>> {
        match self.start_owner {
            Some(start_owner) => Ok(host
                .alloc(AllocRequest {
                    chain: ChainStart::Extend {
                        start_owner,
                        prefix_tokens: 0,
                    },
                    pages: self.device_pages.len(),
                })?
                .pages),
            None => host.alloc_matching(&self.device_pages),
        }
    }
}

/// Where a node stands on the host.
#[derive(Debug)]
pub(super) struct HostNode {
    pub(super) host_pages: Vec<LogicalPage>,
    pub(super) acked: bool,
}

/// One rank's HiCache controller.
pub struct HiCacheController {
    device: Arc<DevicePool>,
    host: Arc<HostPool>,
    pub(super) streams: Streams,
    policy: WritePolicy,
    pub(super) allocator: ShardAllocator,
    signals: LayerSignals,
    hits: HashMap<u64, u32>,
    pub(super) host_nodes: HashMap<u64, HostNode>,
    pub(super) backups: VecDeque<Pending<BackupAck>>,
    pub(super) loads: VecDeque<Pending<LoadAck>>,
    next_backup: u64,
    next_load: u64,
    pub(super) spare_tables: Vec<TableBuffer>,
    staging_pages: u64,
    load_staging: Option<StagedIo>,
    backup_staging: Option<StagedIo>,
    /// The L3 stage (`storage_stage.rs`; its calls in `storage.rs`), once attached.
    #[cfg(feature = "nixl")]
    pub(super) storage: Option<super::storage_stage::StorageStage>,
}

impl std::fmt::Debug for HiCacheController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HiCacheController")
            .field("policy", &self.policy)
            .field("host_nodes", &self.host_nodes.len())
            .field("pending_backups", &self.backups.len())
            .field("pending_loads", &self.loads.len())
            .field("staging_bytes", &self.staging_bytes())
            .finish_non_exhaustive()
    }
}

impl HiCacheController {
    /// A controller moving pages between `device` and `host` (same geometry) on `streams`.
    pub fn new(
        device: Arc<DevicePool>,
        host: Arc<HostPool>,
        streams: Streams,
        policy: WritePolicy,
    ) -> Result<Self> {
        super::direct::check_pools(&device, &host)?;
        for stream in streams.all() {
            // check_pools put both pools in one address space.
            crate::backend::check_space(stream.address_space(), device.address_space(), "pools")?;
        }
        let allocator = ShardAllocator::new(device.placement(), host.pages())?;
        let signals = LayerSignals::new(streams.tables.as_ref(), device.geometry().model_layers())?;
        Ok(Self {
            device,
            host,
            streams,
            policy,
            allocator,
            signals,
            hits: HashMap::new(),
            host_nodes: HashMap::new(),
            backups: VecDeque::new(),
            loads: VecDeque::new(),
            next_backup: 0,
            next_load: 0,
            spare_tables: Vec::new(),
            staging_pages: DEFAULT_STAGING_PAGES,
            load_staging: None,
            backup_staging: None,
            #[cfg(feature = "nixl")]
            storage: None,
        })
    }

    /// The write policy.
    pub fn policy(&self) -> WritePolicy {
        self.policy
    }

    /// The streams.
    pub fn streams(&self) -> &Streams {
        &self.streams
    }

    /// The device pool.
    pub fn device(&self) -> &Arc<DevicePool> {
        &self.device
    }

    /// The host pool.
    pub fn host(&self) -> &Arc<HostPool> {
        &self.host
    }

    /// The host allocator (logical host pages, replicated on every rank).
    pub fn host_allocator(&self) -> &ShardAllocator {
        &self.allocator
    }

    /// Pages each of a direction's two staging buffers holds ([`DEFAULT_STAGING_PAGES`] unless
    /// set).
    pub fn staging_pages(&self) -> u64 {
        self.staging_pages
    }

    /// Sets the pages of each staging buffer of later [`Route::Staged`] transfers. Refused,
    /// changing nothing, for 0 pages or while a transfer is pending (it may be using the
    /// staging); staging of another size made earlier is freed and made anew when next needed.
    pub fn set_staging_pages(&mut self, pages: u64) -> Result<()> {
        if pages == 0 {
            return Err(Error::InvalidArgument("staging of 0 pages".into()));
        }
        if !self.backups.is_empty() || !self.loads.is_empty() {
            return Err(Error::HiCache(format!(
                "staging resized with {} backups and {} loads pending",
                self.backups.len(),
                self.loads.len()
            )));
        }
        if pages != self.staging_pages {
            self.load_staging = None;
            self.backup_staging = None;
            self.staging_pages = pages;
        }
        Ok(())
    }

    /// Makes both directions' staging now (`2 * staging_pages` pages of device memory each),
    /// unless made already, so that the first [`Route::Staged`] backup and load do not allocate
    /// inside an engine's step: a device allocation is not stream-ordered, and CUDA allows it to
    /// synchronize the device.
    /// Engines call it once after [`HiCacheController::new`] (and after
    /// [`HiCacheController::set_staging_pages`]); without it the staging is made by the first
    /// staged transfer of each direction. Refused, changing nothing, if the device's memory
    /// cannot hold it ([`Error`] from the allocation).
    pub fn prepare_staging(&mut self) -> Result<()> {
        self.make_staging(Direction::Load)?;
        self.make_staging(Direction::Backup)
    }

    /// Makes `direction`'s staging unless it is made: what [`Self::prepare_staging`] does up
    /// front and the first staged transfer of a direction does otherwise.
    fn make_staging(&mut self, direction: Direction) -> Result<()> {
        let staging = match direction {
            Direction::Load => &mut self.load_staging,
            Direction::Backup => &mut self.backup_staging,
        };
        if staging.is_none() {
            *staging = Some(StagedIo::between(
                self.streams.tables.as_ref(),
                self.device.id(),
                &self.host,
                direction,
                self.staging_pages,
            )?);
        }
        Ok(())
    }

    /// Device bytes of the staging made so far (both directions).
    pub fn staging_bytes(&self) -> usize {
        [&self.load_staging, &self.backup_staging]
            .into_iter()
            .flatten()
            .map(StagedIo::bytes)
            .sum()
    }

    /// Logical host pages of `node`, once its backup has been acked.
    pub fn host_pages(&self, node: u64) -> Option<&[LogicalPage]> {
        self.host_nodes
            .get(&node)
            .filter(|n| n.acked)
            .map(|n| n.host_pages.as_slice())
    }

    /// Records an access (insertion or hit) of `node`; backs it up when the policy says so.
    /// Returns the backup's queue index when one was submitted. A route that cannot run is
    /// refused before the access is counted.
    pub fn access(
        &mut self,
        node: &CacheNode,
        compute: &Event,
        route: impl Into<Route>,
    ) -> Result<Option<u64>> {
        let route = route.into();
        check_route(route)?;
        let hits = self.hits.entry(node.id).or_default();
        *hits = hits.saturating_add(1);
        let due = self.policy.access_threshold().is_some_and(|t| *hits >= t);
        if due && !self.host_nodes.contains_key(&node.id) {
            return self.backup(node, compute, route).map(Some);
        }
        Ok(None)
    }

    /// `node` is leaving the device pool: once this returns, its device pages may be reused
    /// (the engine frees them; the controller never does). Under write-back a node not on the
    /// host yet is backed up first; a backup of the node still in flight is waited for. Both
    /// block (on the backup stream) and pop, in FIFO order, every ack up to the node's, which
    /// are returned. A write-through node never backed up is simply dropped.
    pub fn evict_sync(
        &mut self,
        node: &CacheNode,
        compute: &Event,
        route: impl Into<Route>,
    ) -> Result<Vec<BackupAck>> {
        let route = route.into();
        check_route(route)?;
        if !self.host_nodes.contains_key(&node.id) {
            if self.policy != WritePolicy::WriteBack {
                self.hits.remove(&node.id);
                return Ok(Vec::new());
            }
            self.backup(node, compute, route)?;
        }
        self.hits.remove(&node.id);
        match self.backups.iter().position(|p| p.ack.node == node.id) {
            Some(at) => self.ack_backups_sync(at + 1),
            None => Ok(Vec::new()),
        }
    }

    /// Backs `node` up: allocates its host pages, then, on the backup stream and after
    /// `compute`, copies every layer of this rank's pages. Returns the queue index.
    ///
    /// Everything is checked, and the kernel tables and staging made, before anything is
    /// enqueued. On any error the host pages go back to the allocator, after the backup stream
    /// has passed whatever part of the backup was enqueued.
    pub fn backup(
        &mut self,
        node: &CacheNode,
        compute: &Event,
        route: impl Into<Route>,
    ) -> Result<u64> {
        let route = route.into().resolve(
            Direction::Backup,
            node.device_pages.len(),
            self.host.layout(),
            self.streams.backup.as_ref(),
        );
        if self.host_nodes.contains_key(&node.id) {
            return Err(Error::HiCache(format!(
                "node {} is already on the host",
                node.id
            )));
        }
        check_route(route)?;
        let host_pages = node.alloc_host_pages(&mut self.allocator)?;
        let transfer =
            match self.transfer(&node.device_pages, &host_pages, Direction::Backup, route) {
                Ok(t) => t,
                Err(e) => return Err(self.give_back(&host_pages, e)),
            };
        let enqueued = self.enqueue_backup(&transfer, compute, route);
        let done = match enqueued {
            Ok(done) => done,
            Err(e) => return Err(self.give_back(&host_pages, e)),
        };
        let bytes = transfer.bytes(Layers::All)?;
        let index = self.next_backup;
        self.next_backup += 1;
        self.host_nodes.insert(
            node.id,
            HostNode {
                host_pages: host_pages.clone(),
                acked: false,
            },
        );
        self.backups.push_back(Pending {
            ack: BackupAck {
                index,
                node: node.id,
                start_owner: node.start_owner,
                host_pages,
                bytes,
            },
            done,
            transfer,
        });
        Ok(index)
    }

    fn enqueue_backup(
        &self,
        transfer: &HostTransfer,
        compute: &Event,
        route: Route,
    ) -> Result<Event> {
        let backup = self.streams.backup.as_ref();
        backup.wait(compute)?;
        match route {
            Route::Direct(io) => transfer.run(backup, io, Layers::All)?,
            Route::Staged(how) => transfer.run_staged(
                backup,
                self.streams.backup_relayout.as_ref(),
                made(&self.backup_staging)?,
                how,
            )?,
            Route::Auto => return Err(unresolved()),
        }
        backup.record()
    }

    /// Returns `pages` to the host allocator after a failed backup; hands back the error to
    /// report. Nothing waits: whatever of the backup was enqueued is recorded on the host
    /// pool's usage, so a later transfer into those pages is ordered after it.
    fn give_back(&mut self, pages: &[LogicalPage], error: Error) -> Error {
        match self.allocator.free(pages) {
            Ok(()) => error,
            Err(free) => {
                Error::HiCache(format!("{error}; returning its host pages failed: {free}"))
            }
        }
    }

    /// Loads backed-up `node` into logical device pages `device_pages` (allocated by the caller
    /// with the owner classes of the node's host pages, e.g. `ShardAllocator::alloc_matching`),
    /// on the load stream after `after` when given. [`Method::Kernel`] loads every layer in
    /// one launch with a ready counter per layer; the other methods move layer after layer
    /// (target layer 0 together with the draft), recording an event after each;
    /// [`Route::Staged`] moves every layer at once, and each layer's readiness is the event
    /// recorded after the whole load. Everything is checked, and the kernel tables and staging
    /// made, before anything is enqueued.
    pub fn load(
        &mut self,
        node: u64,
        device_pages: &[LogicalPage],
        after: Option<&Event>,
        route: impl Into<Route>,
    ) -> Result<LoadHandle> {
        let route = route.into().resolve(
            Direction::Load,
            device_pages.len(),
            self.host.layout(),
            self.streams.load.as_ref(),
        );
        check_route(route)?;
        let host_pages = self
            .host_pages(node)
            .ok_or_else(|| Error::HiCache(format!("node {node} has no acked backup to load")))?
            .to_vec();
        let transfer = self.transfer(device_pages, &host_pages, Direction::Load, route)?;
        let load = self.streams.load.as_ref();
        if let Some(event) = after {
            load.wait(event)?;
        }
        let model_layers = transfer.model_layers();
        let layers: Vec<LayerReady> = match route {
            Route::Direct(Method::Kernel(launch)) => transfer
                .run_signalled(load, launch, &mut self.signals)?
                .into_iter()
                .map(LayerReady::Counter)
                .collect(),
            Route::Direct(io) => {
                let mut ready: Vec<Option<LayerReady>> = vec![None; model_layers];
                for m in (0..model_layers).map(ModelLayer) {
                    let group = transfer.group(m);
                    if group != m {
                        continue;
                    }
                    transfer.run(load, io, Layers::One(m))?;
                    ready[m.0] = Some(LayerReady::Event(load.record()?));
                }
                (0..model_layers)
                    .map(|m| {
                        let group = transfer.group(ModelLayer(m)).0;
                        ready[group].clone().ok_or_else(|| {
                            Error::HiCache(format!("model layer {m} has no readiness group"))
                        })
                    })
                    .collect::<Result<_>>()?
            }
            Route::Staged(how) => {
                let staging = made(&self.load_staging)?;
                transfer.run_staged(load, self.streams.load_relayout.as_ref(), staging, how)?;
                let done = LayerReady::Event(load.record()?);
                vec![done; model_layers]
            }
            Route::Auto => return Err(unresolved()),
        };
        let done = load.record()?;
        let index = self.next_load;
        self.next_load += 1;
        self.loads.push_back(Pending {
            ack: LoadAck {
                index,
                node,
                bytes: transfer.bytes(Layers::All)?,
            },
            done,
            transfer,
        });
        Ok(LoadHandle { index, layers })
    }

    /// Drops `node` from the host pool, returning its host pages to the allocator. Refused while
    /// its backup is unacked or a load of it is pending.
    pub fn free_host(&mut self, node: u64) -> Result<()> {
        let busy = self.loads.iter().any(|p| p.ack.node == node);
        #[cfg(feature = "nixl")]
        let busy = busy || self.storage_busy(node);
        match self.host_nodes.get(&node) {
            None => Err(Error::HiCache(format!("node {node} is not on the host"))),
            Some(n) if !n.acked || busy => Err(Error::HiCache(format!(
                "node {node} still has a transfer in flight"
            ))),
            Some(n) => {
                self.allocator.free(&n.host_pages)?;
                self.host_nodes.remove(&node);
                Ok(())
            }
        }
    }

    /// Plans and builds this rank's transfer, uploading kernel tables on the tables stream
    /// (into a spare table buffer when one fits) when a kernel will read them, and making the
    /// direction's staging on its first staged use.
    fn transfer(
        &mut self,
        device_pages: &[LogicalPage],
        host_pages: &[LogicalPage],
        direction: Direction,
        route: Route,
    ) -> Result<HostTransfer> {
        let plan = TransferPlan::new(
            self.device.placement(),
            self.device.rank(),
            device_pages,
            host_pages,
            self.device.pages(),
            self.host.pages(),
        )?;
        let mut transfer =
            HostTransfer::new(self.device.clone(), self.host.clone(), plan, direction)?;
        let tables = self.streams.tables.clone();
        match route {
            Route::Direct(Method::Kernel(_)) => {
                transfer.prepare_kernel(tables.as_ref(), &mut self.spare_tables)?
            }
            Route::Direct(_) => {}
            Route::Staged(how) => {
                self.make_staging(direction)?;
                let staging = match direction {
                    Direction::Load => &self.load_staging,
                    Direction::Backup => &self.backup_staging,
                };
                if let (Method::Kernel(_), Some(staging)) = (how, staging.as_ref()) {
                    transfer.prepare_staged(tables.as_ref(), staging, &mut self.spare_tables)?;
                }
            }
            Route::Auto => return Err(unresolved()),
        }
        Ok(transfer)
    }
}

/// A direction's staging, which `HiCacheController::transfer` makes for every staged route.
fn made(staging: &Option<StagedIo>) -> Result<&StagedIo> {
    staging
        .as_ref()
        .ok_or_else(|| Error::HiCache("staged transfer without its staging".into()))
}

// Acks: counted without waiting, popped in submission order, and the step of the engine's loop.
impl HiCacheController {
    /// Backups submitted and not yet acked.
    pub fn pending_backups(&self) -> usize {
        self.backups.len()
    }

    /// Loads submitted and not yet acked.
    pub fn pending_loads(&self) -> usize {
        self.loads.len()
    }

    /// How many backups, from the oldest, have completed (what the shard group takes the
    /// minimum of before acking).
    pub fn poll_backups(&self) -> Result<usize> {
        completed_prefix(self.streams.backup.as_ref(), &self.backups)
    }

    /// How many loads, from the oldest, have completed.
    pub fn poll_loads(&self) -> Result<usize> {
        completed_prefix(self.streams.load.as_ref(), &self.loads)
    }

    /// Pops the `count` oldest backups, in submission order. If any of them has not completed,
    /// this first blocks until the backup stream is idle.
    pub fn ack_backups_sync(&mut self, count: usize) -> Result<Vec<BackupAck>> {
        let done = pop_completed(self.streams.backup.as_ref(), &mut self.backups, count)?;
        Ok(self.backed_up(done))
    }

    /// Pops the `count` oldest loads, in submission order. If any of them has not completed,
    /// this first blocks until the load stream is idle.
    pub fn ack_loads_sync(&mut self, count: usize) -> Result<Vec<LoadAck>> {
        let done = pop_completed(self.streams.load.as_ref(), &mut self.loads, count)?;
        Ok(self.recycle(done))
    }

    /// The controller's step of the engine's loop: acks every backup and every load that has
    /// completed, each in submission order (what [`Self::ack_backups_sync`] and
    /// [`Self::ack_loads_sync`] of [`Self::poll_backups`] and [`Self::poll_loads`] would give,
    /// with no wait), and reports the inputs a kernel rejected on the controller's streams since
    /// the last step. One call per scheduling step. The ranks of a shard group that must ack
    /// the same counts agree on the polled counts first and pop those (module docs of the
    /// controller); a rank that acks on its own takes its step.
    pub fn step(&mut self) -> Result<HiCacheStep> {
        let backups = self.poll_backups()?;
        let done = self.backups.drain(..backups).collect();
        let backups = self.backed_up(done);
        let loads = self.poll_loads()?;
        let done = self.loads.drain(..loads).collect();
        let loads = self.recycle(done);
        let kernel_errors = self
            .streams
            .all()
            .iter()
            .filter_map(|s| s.poll_kernel_status().err())
            .collect();
        Ok(HiCacheStep {
            backups,
            loads,
            kernel_errors,
        })
    }

    /// Acks completed backups: their nodes are on the host from now on.
    fn backed_up(&mut self, done: Vec<Pending<BackupAck>>) -> Vec<BackupAck> {
        let acks = self.recycle(done);
        for ack in &acks {
            if let Some(n) = self.host_nodes.get_mut(&ack.node) {
                n.acked = true;
            }
        }
        // Write-through to storage starts once the host bytes are complete.
        #[cfg(feature = "nixl")]
        for ack in &acks {
            self.on_backup_acked(ack.node);
        }
        acks
    }

    /// Keeps the kernel tables of completed transfers for reuse; returns their acks.
    fn recycle<A>(&mut self, done: Vec<Pending<A>>) -> Vec<A> {
        let mut acks = Vec::with_capacity(done.len());
        for p in done {
            acks.push(p.ack);
            self.spare_tables.extend(p.transfer.into_tables());
        }
        // The largest fit the most transfers; dropping the rest frees device memory, rarely.
        self.spare_tables
            .sort_by_key(|t| std::cmp::Reverse(t.len()));
        self.spare_tables.truncate(SPARE_TABLES);
        acks
    }
}

fn completed_prefix<A>(stream: &dyn Backend, queue: &VecDeque<Pending<A>>) -> Result<usize> {
    let mut n = 0;
    for p in queue {
        if !stream.is_done(&p.done)? {
            break;
        }
        n += 1;
    }
    Ok(n)
}

/// Pops the `count` oldest entries of `queue`, first waiting for `stream` to be idle if any of
/// them has not completed.
fn pop_completed<A>(
    stream: &dyn Backend,
    queue: &mut VecDeque<Pending<A>>,
    count: usize,
) -> Result<Vec<Pending<A>>> {
    if count > queue.len() {
        return Err(Error::HiCache(format!(
            "{count} acks asked for, {} operations pending",
            queue.len()
        )));
    }
    if completed_prefix(stream, queue)? < count {
        stream.synchronize()?;
    }
    Ok(queue.drain(..count).collect())
}
