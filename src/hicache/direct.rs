//! One rank's share of a HiCache transfer between its device pool and its host pool, straight
//! between the two, with any of four [`Method`]s chosen per call:
//!
//! - [`Method::Kernel`]: `kvs_copy_blocks` reads or writes the pinned host pool through its
//!   device alias (zero-copy), every component of the selected layers in one launch of a
//!   caller-chosen shape ([`Method::host_io`]: the copy kernels' host-I/O shape, two CTAs
//!   saturate PCIe; each takes an SM from the forward pass). Pairs are ordered by readiness group, so with
//!   [`HostTransfer::run_signalled`] one launch loads every layer and publishes each group's
//!   completion on its own counter, group 0 (target layer 0 and the MTP draft) first.
//! - [`Method::CopyEngine`]: DMA in few, large pieces (the copy layer's engine programs):
//!   coalesced runs, 2D copies over layers where the device layer stride is uniform, one batch
//!   for the contiguous rest. Token-major `page_first` latent rows are strided on the host, so
//!   they move as one 2D copy of 576-byte rows per (run, layer).
//! - [`Method::PerBlock`] and [`Method::BatchedCopyEngine`]: one copy-engine call per
//!   (page, layer, component) block (a 2D copy of its rows for token-major latent blocks), or
//!   one `cuMemcpyBatchAsync` holding every block (every row of token-major latent blocks): the
//!   baselines benchmarks compare against.
//!
//! [`Method::RangeKernel`] is refused ([`Error::UnsupportedMethod`]).
//!
//! Everything is computed from a [`TransferPlan`] (local pages, checked against both pools
//! here) and the pools' address math.

use std::sync::Arc;

use super::transfer_plan::TransferPlan;
use crate::backend::{Backend, Launch, Pages};
use crate::copy::dma::{self, Sides};
use crate::copy::{
    BlockCopy, BlockCopyPlan, BlockSpace, CounterWait, Direction, IoCalls, LayerSignals, Layers,
    Method, PageSelection, TableBuffer,
};
use crate::error::{Error, Result};
use crate::index::ModelLayer;
use crate::pool::host::HostPool;
use crate::pool::DevicePool;

/// Refuses, before anything is enqueued, a method [`HostTransfer::run`] cannot run: the range
/// kernel, or a kernel launch shape no copy kernel takes.
pub(crate) fn check_direct(method: Method) -> Result<()> {
    match method {
        Method::Kernel(launch) => launch.validate(crate::abi::KVS_COPY_THREADS),
        Method::CopyEngine | Method::BatchedCopyEngine | Method::PerBlock => Ok(()),
        Method::RangeKernel(_) => Err(Error::UnsupportedMethod {
            method: method.to_string(),
            route: "a direct HiCache transfer",
            accepts: "Kernel, CopyEngine, BatchedCopyEngine or PerBlock",
        }),
    }
}

/// One rank's share of a HiCache transfer, checked against both pools and ready to run
/// (repeatedly) with any [`Method`] it takes or through staging. It holds both pools.
#[derive(Debug)]
pub struct HostTransfer {
    pub(super) device: Arc<DevicePool>,
    pub(super) host: Arc<HostPool>,
    pub(super) plan: TransferPlan,
    pub(super) direction: Direction,
    model_layers: usize,
    /// The target's layer count: the draft's model layer, which readiness groups with layer 0.
    draft_layer: Option<ModelLayer>,
    kernel: Option<BlockCopy>,
    /// The staged kernel relayout: the staging it was made for, and one copy per mirror.
    pub(super) relayout: Option<(crate::copy::SpaceId, Vec<BlockCopy>)>,
}

impl HostTransfer {
    /// Checks `plan` against the pools (same components, the device pool's placement and rank,
    /// every local page inside both pools) and builds everything a run needs on the host.
    /// Nothing is uploaded: kernel runs need [`HostTransfer::prepare_kernel_sync`] first.
    pub fn new(
        device: Arc<DevicePool>,
        host: Arc<HostPool>,
        plan: TransferPlan,
        direction: Direction,
    ) -> Result<Self> {
        check_pools(&device, &host)?;
        if plan.placement() != device.placement() || plan.rank() != device.rank() {
            return Err(Error::HiCache(format!(
                "plan for rank {} of {} used with the device pool of rank {} of {}",
                plan.rank(),
                plan.placement().shard(),
                device.rank(),
                device.placement().shard()
            )));
        }
        let beyond = |pages: &[crate::index::LocalPage], limit: u64| {
            pages.iter().find(|p| p.0 >= limit).copied()
        };
        for (side, bad, limit) in [
            (
                "device",
                beyond(plan.device_pages(), device.pages()),
                device.pages(),
            ),
            (
                "host",
                beyond(plan.host_pages(), host.pages()),
                host.pages(),
            ),
        ] {
            if let Some(page) = bad {
                return Err(Error::HiCache(format!(
                    "the plan moves {side} {page}, the {side} pool holds {limit} pages"
                )));
            }
        }
        let geometry = device.geometry();
        let draft_layer = geometry
            .draft
            .as_ref()
            .map(|_| ModelLayer(geometry.target.num_layers()));
        Ok(Self {
            model_layers: geometry.model_layers(),
            draft_layer,
            device,
            host,
            plan,
            direction,
            kernel: None,
            relayout: None,
        })
    }

    /// The plan this transfer runs.
    pub fn plan(&self) -> &TransferPlan {
        &self.plan
    }

    /// Which way it moves pages.
    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// Model layers of the cache (the index space of [`Layers::One`] and of readiness).
    pub fn model_layers(&self) -> usize {
        self.model_layers
    }

    /// The readiness group of model layer `m`: itself, or layer 0 for the MTP draft's layer.
    pub fn group(&self, m: ModelLayer) -> ModelLayer {
        if Some(m) == self.draft_layer {
            ModelLayer(0)
        } else {
            m
        }
    }

    /// Which model layers `layers` moves.
    pub(super) fn selects(&self, layers: Layers) -> impl Fn(ModelLayer) -> bool + '_ {
        move |m| match layers {
            Layers::All => true,
            Layers::One(one) => self.group(m) == self.group(one),
        }
    }

    /// The spaces in copy order for this direction: (source, destination).
    pub(super) fn ends(&self) -> (Arc<dyn BlockSpace>, Arc<dyn BlockSpace>) {
        let (device, host): (Arc<dyn BlockSpace>, Arc<dyn BlockSpace>) =
            (self.device.clone(), self.host.clone());
        match self.direction {
            crate::copy::Direction::Load => (host, device),
            crate::copy::Direction::Backup => (device, host),
        }
    }

    /// The pages this transfer touches in the device pool and in the host pool (what its
    /// copies' usages order: a load and a backup of other pages of the same pools on two
    /// streams run at once).
    pub(super) fn touched(&self) -> (Pages, Pages) {
        (
            Pages::of(self.plan.device_pages().iter().map(|p| p.0)),
            Pages::of(self.plan.host_pages().iter().map(|p| p.0)),
        )
    }

    /// The block copy of every pair of this transfer between the pools, by readiness group.
    fn kernel_plan(&self) -> Result<BlockCopyPlan> {
        let device = PageSelection::Local(self.plan.device_pages().to_vec());
        let host = PageSelection::Local(self.plan.host_pages().to_vec());
        let n = self.plan.len();
        let plan = match self.direction {
            Direction::Load => {
                BlockCopyPlan::new(self.host.as_ref(), host, self.device.as_ref(), device, n)
            }
            Direction::Backup => {
                BlockCopyPlan::new(self.device.as_ref(), device, self.host.as_ref(), host, n)
            }
        }?;
        Ok(plan.map_signals(|m| self.group(m)).layer_major())
    }

    /// Uploads the kernel's tables through `backend`, waiting for the upload (use a stream
    /// other than the one transfers run on), into a buffer of `spare` when one fits (tables of
    /// completed transfers, [`HostTransfer::into_tables`]): allocating and freeing device
    /// memory per transfer would serialize the device's streams.
    pub fn prepare_kernel_sync(
        &mut self,
        backend: &dyn Backend,
        spare: &mut Vec<TableBuffer>,
    ) -> Result<()> {
        self.prepare_kernel(backend, spare)?;
        backend.synchronize()
    }

    /// [`HostTransfer::prepare_kernel_sync`] without the wait: the upload is enqueued on
    /// `backend`'s stream, and the runs on any stream are ordered after it.
    pub fn prepare_kernel(
        &mut self,
        backend: &dyn Backend,
        spare: &mut Vec<TableBuffer>,
    ) -> Result<()> {
        if self.kernel.is_some() || self.plan.is_empty() {
            return Ok(());
        }
        let plan = self.kernel_plan()?;
        let reuse = take_fit(spare, plan.table_bytes());
        let (src, dst) = self.ends();
        self.kernel = Some(BlockCopy::prepare(backend, plan, src, dst, reuse)?);
        Ok(())
    }

    /// The tables of every prepared copy, for later transfers to reuse: an upload into them is
    /// ordered after the runs of this transfer still queued.
    pub fn into_tables(self) -> Vec<TableBuffer> {
        self.kernel
            .into_iter()
            .chain(self.relayout.into_iter().flat_map(|(_, copies)| copies))
            .filter_map(BlockCopy::into_tables)
            .collect()
    }

    /// Bytes of device memory the kernel's tables take: the pair table, then both page lists.
    pub fn kernel_table_bytes(&self) -> usize {
        let pairs: usize = self.device.components().iter().map(|c| c.layers()).sum();
        24 * pairs + 16 * self.plan.len()
    }

    fn sides(&self) -> Sides<'_> {
        Sides {
            device: self.device.as_ref(),
            host: self.host.as_ref(),
            runs: self.plan.runs(),
            device_pages: self.plan.device_pages(),
            host_pages: self.plan.host_pages(),
        }
    }

    /// Bytes one run of `layers` moves (each byte read once and written once).
    pub fn bytes(&self, layers: Layers) -> Result<u64> {
        self.check_layers(layers)?;
        let select = self.selects(layers);
        let per_page: u64 = self
            .device
            .components()
            .iter()
            .map(|c| {
                c.model_layers.iter().filter(|&&m| select(m)).count() as u64 * c.block_bytes as u64
            })
            .sum();
        Ok(per_page * self.plan.len() as u64)
    }

    fn check_layers(&self, layers: Layers) -> Result<()> {
        match layers {
            Layers::One(m) if m.0 >= self.model_layers => Err(Error::OutOfRange {
                what: "model layer",
                index: m.0 as i64,
                limit: self.model_layers as u64,
            }),
            _ => Ok(()),
        }
    }

    /// The copy-engine calls one run of `layers` with `method` makes (none for a kernel).
    fn program(&self, method: Method, layers: Layers) -> Vec<dma::Call> {
        if self.plan.is_empty() {
            return Vec::new();
        }
        let select = self.selects(layers);
        let sides = self.sides();
        match method {
            Method::Kernel(_) | Method::RangeKernel(_) => Vec::new(),
            Method::CopyEngine => sides.coalesced(&select, self.direction),
            Method::PerBlock => sides.per_block(&select, self.direction),
            Method::BatchedCopyEngine => sides.batch(&select, self.direction),
        }
    }

    /// The launches and copy-engine calls one run of `layers` with `method` submits.
    pub fn calls(&self, method: Method, layers: Layers) -> Result<IoCalls> {
        check_direct(method)?;
        self.check_layers(layers)?;
        let mut n = IoCalls::count(&self.program(method, layers));
        if matches!(method, Method::Kernel(_)) && !self.plan.is_empty() {
            n.launches = 1;
        }
        Ok(n)
    }

    /// Checks `backend` runs in the pools' address space.
    pub(super) fn check_backend(&self, backend: &dyn Backend) -> Result<()> {
        crate::backend::check_space(
            backend.address_space(),
            self.device.address_space(),
            "the pools",
        )
    }

    fn kernel(&self) -> Result<&BlockCopy> {
        self.kernel.as_ref().ok_or_else(|| {
            Error::HiCache(
                "the SM kernel and staged paths need HostTransfer::prepare_kernel_sync first"
                    .into(),
            )
        })
    }

    /// Enqueues the copies of `layers` on `backend`'s stream with `method`: [`Method::Kernel`],
    /// [`Method::CopyEngine`], [`Method::BatchedCopyEngine`] or [`Method::PerBlock`]; the range
    /// kernel is [`Error::UnsupportedMethod`]. A transfer this rank has no pages of enqueues
    /// nothing.
    pub fn run(&self, backend: &dyn Backend, method: Method, layers: Layers) -> Result<()> {
        check_direct(method)?;
        self.check_layers(layers)?;
        self.check_backend(backend)?;
        if self.plan.is_empty() {
            return Ok(());
        }
        match method {
            Method::Kernel(launch) => {
                let kernel = self.kernel()?;
                match layers {
                    Layers::All => kernel.run(backend, launch),
                    Layers::One(m) => kernel.run_layer(backend, self.group(m), launch),
                }
            }
            _ => {
                // SAFETY: every piece lies inside the two pools this transfer holds (alive
                // with it), at local pages `new` checked against both pools' page counts, in
                // stored layers of each component; the backend runs in their address space
                // (checked above).
                let (device, host) = self.touched();
                let (from, to) = self
                    .direction
                    .read_and_written::<(&dyn BlockSpace, &Pages)>(
                        (self.device.as_ref(), &device),
                        (self.host.as_ref(), &host),
                    );
                unsafe { dma::submit(backend, self.program(method, layers), from, to) }
            }
        }
    }

    /// Enqueues every layer as one kernel launch of shape `launch` that counts each finished
    /// (page, layer, component) unit into `signals`; returns, per model layer, the counter value
    /// that means that layer has landed (the draft's is layer 0's). Layers land roughly in
    /// order, group 0 first.
    pub fn run_signalled(
        &self,
        backend: &dyn Backend,
        launch: Launch,
        signals: &mut LayerSignals,
    ) -> Result<Vec<CounterWait>> {
        let waits = if self.plan.is_empty() {
            if signals.layers() != self.model_layers {
                return Err(Error::GeometryMismatch {
                    what: "ready counters".into(),
                    expected: self.model_layers.to_string(),
                    got: signals.layers().to_string(),
                });
            }
            signals.count(&vec![0; self.model_layers])
        } else {
            self.kernel()?.run_signalled(backend, launch, signals)?
        };
        Ok((0..self.model_layers)
            .map(|m| waits[self.group(ModelLayer(m)).0].clone())
            .collect())
    }
}

/// Checks a device pool and a host pool can back each other: the same components, in one
/// address space.
pub(super) fn check_pools(device: &DevicePool, host: &HostPool) -> Result<()> {
    crate::copy::space::check_same_components(device.components(), host.components())?;
    crate::backend::check_space(device.address_space(), host.address_space(), "host pool")
}

/// The smallest spare table buffer holding `need` bytes, taken out of `spare`.
pub(crate) fn take_fit(spare: &mut Vec<TableBuffer>, need: usize) -> Option<TableBuffer> {
    let at = (0..spare.len())
        .filter(|&i| spare[i].len() >= need)
        .min_by_key(|&i| spare[i].len())?;
    Some(spare.swap_remove(at))
}
