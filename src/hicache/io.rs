//! Executing one rank's share of a HiCache transfer between its device pool and its host pool,
//! on any of four I/O backends chosen per call:
//!
//! - [`IoBackend::SmKernel`]: `kvs_copy_blocks` reads or writes the pinned host pool through its
//!   device alias (zero-copy), every component of the selected layers in one launch of a
//!   caller-chosen number of 1024-thread CTAs. Pairs are ordered layer by layer, so with
//!   [`HostTransfer::run_signalled`] one launch loads every layer and publishes each layer's
//!   completion on its own counter, layer 0 first.
//! - [`IoBackend::CopyEngine`]: DMA on the copy engine in few, large pieces. Runs of pages that
//!   advance together on both sides are coalesced; where the device pool's layer stride is
//!   uniform (pools kvshard allocates), a run of every layer is one 2D copy per component
//!   (`layer_first`: rows are layers; `page_first_direct`: one copy per page whose rows are its
//!   layers, or per layer when a run is longer than the layer count). Contiguous pieces of one
//!   call go to the driver as one `cuMemcpyBatchAsync`; token-major `page_first` latent rows are
//!   strided on the host, so they move as one 2D copy of 576-byte rows per (run, layer), which
//!   PERFORMANCE.md measured at ~40 GB/s H2D and costs a call per (run, layer): for that layout
//!   the SM kernel is the fast path.
//! - [`IoBackend::PerBlockMemcpy`] and [`IoBackend::BatchMemcpy`]: one copy-engine call per
//!   (page, layer) block, or one batch call holding every block: the baselines benchmarks
//!   compare against.
//!
//! Everything here is computed from a [`TransferPlan`] (local pages, checked) and the two
//! pools' address math; nothing is resolved on the device.

use std::ops::Range;

use super::host_pool::{HostLayout, HostPool};
use super::plan::TransferPlan;
use crate::abi;
use crate::backend::{Backend, Buffer, Copy2d, Launch, MemoryKind};
use crate::error::{Error, Result};
use crate::pool::{check_same_components, BlockCopyPlan, BlockSpace, DevicePool, PageSelection};

/// Largest pitch a 2D copy may use (`CU_DEVICE_ATTRIBUTE_MAX_PITCH`, 2^31 - 1 on every current
/// NVIDIA GPU): larger strides (the layer stride of a big `layer_first` host pool) are moved as
/// per-layer pieces instead.
const MAX_2D_PITCH: u64 = i32::MAX as u64;

/// Which way a transfer moves pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Host to device (H2D).
    Load,
    /// Device to host (D2H).
    Backup,
}

/// How the bytes of a transfer are moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoBackend {
    /// The block-copy kernel through the host pool's device alias, `ctas` CTAs of 1024 threads
    /// (two saturate PCIe; each takes an SM from the forward pass).
    SmKernel {
        /// CTAs per launch (at least one).
        ctas: u32,
    },
    /// Coalesced copy-engine copies (2D over layers where the device layer stride is uniform).
    CopyEngine,
    /// One copy-engine call per (page, layer, component) block (a 2D copy of its rows for
    /// token-major latent blocks).
    PerBlockMemcpy,
    /// One `cuMemcpyBatchAsync` holding every block (every row of token-major latent blocks).
    BatchMemcpy,
}

impl std::fmt::Display for IoBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::SmKernel { ctas } => write!(f, "sm-kernel x{ctas}"),
            Self::CopyEngine => f.write_str("copy-engine"),
            Self::PerBlockMemcpy => f.write_str("per-block-memcpy"),
            Self::BatchMemcpy => f.write_str("batch-memcpy"),
        }
    }
}

/// Which model layers a call moves (model layers number the target's layers, then the draft's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layers {
    /// Every component of every layer.
    All,
    /// Every component of one model layer.
    One(usize),
}

/// What one run of a transfer submits: launches and copy-engine calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct IoCalls {
    /// `kvs_copy_blocks` launches.
    pub launches: usize,
    /// One-dimensional copy-engine copies.
    pub memcpy: usize,
    /// 2D copy-engine copies.
    pub memcpy_2d: usize,
    /// Batch calls.
    pub batch_calls: usize,
    /// Entries over every batch call.
    pub batch_entries: usize,
}

/// Per-model-layer u32 ready counters that signalled launches count into.
///
/// Counters only grow: each signalled run adds its units to the targets kept here, so the
/// target of a layer covers every run counted so far. Runs that count into one set of
/// counters must be enqueued on one stream, in the order they were counted.
#[derive(Debug)]
pub struct LayerSignals {
    counters: Buffer,
    targets: Vec<u32>,
}

impl LayerSignals {
    /// Zeroed counters for `model_layers` layers in `backend`'s device memory (the upload
    /// synchronizes `backend`'s stream).
    pub fn new<B: Backend>(backend: &B, model_layers: usize) -> Result<Self> {
        let counters = backend.alloc(4 * model_layers.max(1), MemoryKind::Device)?;
        backend.write(&counters, 0, &vec![0u8; counters.len()])?;
        Ok(Self {
            counters,
            targets: vec![0; model_layers],
        })
    }

    /// Model layers counted.
    pub fn layers(&self) -> usize {
        self.targets.len()
    }

    /// The counters, one little-endian u32 per model layer.
    pub fn counters(&self) -> &Buffer {
        &self.counters
    }

    /// What model layer `layer`'s counter reaches once every counted run has landed it.
    pub fn target(&self, layer: usize) -> Result<u32> {
        self.targets.get(layer).copied().ok_or(Error::OutOfRange {
            what: "model layer",
            index: layer as i64,
            limit: self.targets.len() as u64,
        })
    }

    /// Adds a run's units per layer; returns the readiness of each layer after that run.
    fn count(&mut self, units: &[u32]) -> Vec<CounterWait> {
        self.targets
            .iter_mut()
            .zip(units)
            .enumerate()
            .map(|(layer, (target, &n))| {
                *target = target.wrapping_add(n);
                CounterWait {
                    counters: self.counters.clone(),
                    layer,
                    target: *target,
                }
            })
            .collect()
    }
}

/// "Model layer `layer` has landed" as a counter value to wait for.
#[derive(Debug, Clone)]
pub struct CounterWait {
    counters: Buffer,
    layer: usize,
    target: u32,
}

impl CounterWait {
    /// Makes later work on `consumer` wait until the layer has landed (no host involvement).
    pub fn wait<B: Backend>(&self, consumer: &B) -> Result<()> {
        let addr = self.counters.at(4 * self.layer)?;
        // SAFETY: `addr` is a 4-byte aligned u32 inside the counters allocation (256-byte
        // aligned base, 4 bytes per layer, checked by `at`), which this value keeps alive.
        unsafe { consumer.wait_counter(addr, self.target) }
    }

    /// The model layer.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// The counter value that means the layer has landed.
    pub fn target(&self) -> u32 {
        self.target
    }
}

/// How a consumer learns that one model layer of a load has landed.
#[derive(Debug)]
pub enum LayerReady<E> {
    /// An event recorded on the load stream after the layer's copies.
    Event(E),
    /// A ready counter reaching a target (one-launch loads).
    Counter(CounterWait),
}

impl<E> LayerReady<E> {
    /// Makes later work on `consumer` wait for this layer only.
    pub fn wait<B: Backend<Event = E>>(&self, consumer: &B) -> Result<()> {
        match self {
            Self::Event(e) => consumer.wait(e),
            Self::Counter(c) => c.wait(consumer),
        }
    }
}

/// Bytes of one `kvs_layer_pair` in a table.
const PAIR_BYTES: usize = 24;

/// One contiguous or 2D stretch, in device-side / host-side terms (direction-free).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    device: u64,
    device_pitch: u64,
    host: u64,
    host_pitch: u64,
    width: u64,
    height: u64,
}

impl Piece {
    fn contiguous(device: u64, host: u64, width: u64) -> Self {
        Self {
            device,
            device_pitch: width,
            host,
            host_pitch: width,
            width,
            height: 1,
        }
    }

    /// Folds rows that are back to back on both sides into one row.
    fn folded(mut self) -> Self {
        if self.height > 1 && self.device_pitch == self.width && self.host_pitch == self.width {
            self.width *= self.height;
            self.height = 1;
            self.device_pitch = self.width;
            self.host_pitch = self.width;
        }
        self
    }

    fn copy(&self, direction: Direction) -> Copy2d {
        let (dst, dst_pitch, src, src_pitch) = match direction {
            Direction::Load => (self.device, self.device_pitch, self.host, self.host_pitch),
            Direction::Backup => (self.host, self.host_pitch, self.device, self.device_pitch),
        };
        Copy2d {
            dst,
            dst_pitch,
            src,
            src_pitch,
            width: self.width,
            height: self.height,
        }
    }

    fn range(&self, direction: Direction) -> abi::kvs_range {
        let c = self.copy(direction);
        abi::kvs_range {
            src: c.src,
            dst: c.dst,
            bytes: c.width,
        }
    }
}

/// One backend call of a run.
#[derive(Debug)]
enum Call {
    Memcpy(Copy2d),
    Memcpy2d(Copy2d),
    Batch(Vec<abi::kvs_range>),
    Kernel { pairs: Range<usize>, ctas: u32 },
}

/// One rank's share of a HiCache transfer, checked against both pools and ready to run
/// (repeatedly) on any [`IoBackend`]. It borrows the pools, so they outlive it.
#[derive(Debug)]
pub struct HostTransfer<'a> {
    device: &'a DevicePool,
    host: &'a HostPool,
    plan: TransferPlan,
    direction: Direction,
    model_layers: usize,
    kernel_components: [abi::kvs_block_component; abi::KVS_MAX_COMPONENTS as usize],
    num_components: u32,
    /// Every (component, layer) pair, layer-major: a layer's pairs are one range of the table.
    pairs: Vec<abi::kvs_layer_pair>,
    /// Range of `pairs` of each model layer.
    layer_pairs: Vec<Range<usize>>,
    /// Units each model layer's counter gains per signalled run of every layer.
    signal_units: Vec<u32>,
    /// Device copy of the pair table, then the device and host page lists (i64 each).
    tables: Option<Buffer>,
}

impl<'a> HostTransfer<'a> {
    /// Checks `plan` against the pools (same components, the device pool's placement and rank,
    /// local pages in range) and builds everything a run needs on the host. Nothing is
    /// uploaded: [`IoBackend::SmKernel`] runs need [`HostTransfer::prepare_kernel`] first.
    pub fn new(
        device: &'a DevicePool,
        host: &'a HostPool,
        plan: TransferPlan,
        direction: Direction,
    ) -> Result<Self> {
        check_same_components(device.components(), host.components())?;
        if plan.placement() != device.placement() || plan.rank() != device.rank() {
            return Err(Error::HiCache(format!(
                "plan for rank {} of {} used with the device pool of rank {} of {}",
                plan.rank(),
                plan.placement().shard(),
                device.rank(),
                device.placement().shard()
            )));
        }
        let ids = |pages: &[u64]| PageSelection::Local(pages.iter().map(|&p| p as i64).collect());
        let (dev_sel, host_sel) = (ids(plan.device_pages()), ids(plan.host_pages()));
        let mut block_plan = match direction {
            Direction::Load => BlockCopyPlan::new(host, host_sel, device, dev_sel, plan.len()),
            Direction::Backup => BlockCopyPlan::new(device, dev_sel, host, host_sel, plan.len()),
        }?;
        let model_layers = device.geometry().model_layers();
        // Layer-major order makes layer 0's units the first a launch finishes.
        block_plan.pairs.sort_by_key(|p| p.signal);
        let mut layer_pairs = vec![0..0; model_layers];
        for (k, p) in block_plan.pairs.iter().enumerate() {
            let r = &mut layer_pairs[p.signal as usize];
            if r.end == 0 {
                r.start = k;
            }
            r.end = k + 1;
        }
        let mut kernel_components =
            [abi::kvs_block_component::default(); abi::KVS_MAX_COMPONENTS as usize];
        kernel_components[..block_plan.components.len()].copy_from_slice(&block_plan.components);
        Ok(Self {
            device,
            host,
            direction,
            model_layers,
            kernel_components,
            num_components: block_plan.components.len() as u32,
            signal_units: block_plan.signal_targets(model_layers),
            pairs: block_plan.pairs,
            layer_pairs,
            plan,
            tables: None,
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

    /// Model layers of the cache (the index space of [`Layers::One`] and of ready signals).
    pub fn model_layers(&self) -> usize {
        self.model_layers
    }

    /// Bytes of device memory the kernel's tables take (the pair table, then both page lists).
    pub fn kernel_table_bytes(&self) -> usize {
        PAIR_BYTES * self.pairs.len() + 16 * self.plan.len()
    }

    /// Uploads the kernel's tables through `backend` (whose stream this synchronizes: use a
    /// stream other than the one transfers run on), into `reuse` when given (device memory of
    /// at least [`HostTransfer::kernel_table_bytes`] that no work in flight still reads, e.g.
    /// from [`HostTransfer::into_kernel_tables`] of a completed transfer), else into a new
    /// allocation. Reuse matters where transfers are made per request: allocating and freeing
    /// device memory serializes the device's streams. A transfer this rank has no pages of
    /// needs no tables; `reuse` is then handed back by [`HostTransfer::into_kernel_tables`].
    pub fn prepare_kernel<B: Backend>(&mut self, backend: &B, reuse: Option<Buffer>) -> Result<()> {
        if self.tables.is_some() {
            return Ok(());
        }
        if self.plan.is_empty() {
            self.tables = reuse;
            return Ok(());
        }
        let need = self.kernel_table_bytes();
        let tables = match reuse {
            Some(b) if b.len() >= need && b.kind() == MemoryKind::Device => b,
            Some(b) => {
                return Err(Error::InvalidArgument(format!(
                    "kernel tables of {need} bytes do not fit a reused {:?} buffer of {} bytes",
                    b.kind(),
                    b.len()
                )))
            }
            None => backend.alloc(need, MemoryKind::Device)?,
        };
        let mut bytes = Vec::with_capacity(need);
        crate::backend::extend_pair_table(&mut bytes, &self.pairs);
        let pages = self
            .plan
            .device_pages()
            .iter()
            .chain(self.plan.host_pages());
        bytes.extend(pages.flat_map(|&p| (p as i64).to_le_bytes()));
        backend.write(&tables, 0, &bytes)?;
        self.tables = Some(tables);
        Ok(())
    }

    /// The transfer's kernel-table buffer, to reuse once every run of this transfer has
    /// completed.
    pub fn into_kernel_tables(self) -> Option<Buffer> {
        self.tables
    }

    /// Bytes one run of `layers` moves (each byte read once and written once).
    pub fn bytes(&self, layers: Layers) -> Result<u64> {
        let range = self.pair_range(layers)?;
        let per_page: u64 = self.pairs[range]
            .iter()
            .map(|p| self.device.components()[p.component as usize].block_bytes as u64)
            .sum();
        Ok(per_page * self.plan.len() as u64)
    }

    /// The launches and copy-engine calls one run of `layers` on `io` submits.
    pub fn calls(&self, io: IoBackend, layers: Layers) -> Result<IoCalls> {
        let mut n = IoCalls::default();
        for call in self.program(io, layers)? {
            match call {
                Call::Memcpy(_) => n.memcpy += 1,
                Call::Memcpy2d(_) => n.memcpy_2d += 1,
                Call::Batch(entries) => {
                    n.batch_calls += 1;
                    n.batch_entries += entries.len();
                }
                Call::Kernel { .. } => n.launches += 1,
            }
        }
        Ok(n)
    }

    /// Enqueues the copies of `layers` on `backend`'s stream with `io`. A transfer this rank has
    /// no pages of enqueues nothing.
    pub fn run<B: Backend>(&self, backend: &B, io: IoBackend, layers: Layers) -> Result<()> {
        for call in self.program(io, layers)? {
            self.submit(backend, call, 0)?;
        }
        Ok(())
    }

    /// Enqueues every layer as one kernel launch of `ctas` CTAs that counts each finished
    /// (page, layer, component) unit into `signals`; returns, per model layer, the counter value
    /// that means that layer has landed. Layers land roughly in order, layer 0 first.
    pub fn run_signalled<B: Backend>(
        &self,
        backend: &B,
        ctas: u32,
        signals: &mut LayerSignals,
    ) -> Result<Vec<CounterWait>> {
        if signals.layers() != self.model_layers {
            return Err(Error::GeometryMismatch {
                what: "ready counters".into(),
                expected: self.model_layers.to_string(),
                got: signals.layers().to_string(),
            });
        }
        if !self.plan.is_empty() {
            let call = Call::Kernel {
                pairs: 0..self.pairs.len(),
                ctas,
            };
            self.submit(backend, call, signals.counters().addr())?;
        }
        let units: Vec<u32> = if self.plan.is_empty() {
            vec![0; self.model_layers]
        } else {
            self.signal_units.clone()
        };
        Ok(signals.count(&units))
    }

    fn pair_range(&self, layers: Layers) -> Result<Range<usize>> {
        match layers {
            Layers::All => Ok(0..self.pairs.len()),
            Layers::One(m) => self.layer_pairs.get(m).cloned().ok_or(Error::OutOfRange {
                what: "model layer",
                index: m as i64,
                limit: self.model_layers as u64,
            }),
        }
    }

    /// The calls one run of `layers` on `io` makes, in submission order.
    fn program(&self, io: IoBackend, layers: Layers) -> Result<Vec<Call>> {
        let range = self.pair_range(layers)?;
        if self.plan.is_empty() {
            return Ok(Vec::new());
        }
        let d = self.direction;
        Ok(match io {
            IoBackend::SmKernel { ctas } => vec![Call::Kernel { pairs: range, ctas }],
            IoBackend::CopyEngine => {
                let pieces = self.coalesced_pieces(layers)?;
                let (flat, strided): (Vec<Piece>, Vec<Piece>) =
                    pieces.into_iter().partition(|p| p.height == 1);
                let mut calls: Vec<Call> =
                    strided.iter().map(|p| Call::Memcpy2d(p.copy(d))).collect();
                match flat.as_slice() {
                    [] => {}
                    [one] => calls.push(Call::Memcpy(one.copy(d))),
                    many => calls.push(Call::Batch(many.iter().map(|p| p.range(d)).collect())),
                }
                calls
            }
            IoBackend::PerBlockMemcpy => self
                .block_pieces(layers, false)
                .iter()
                .map(|p| {
                    if p.height == 1 {
                        Call::Memcpy(p.copy(d))
                    } else {
                        Call::Memcpy2d(p.copy(d))
                    }
                })
                .collect(),
            IoBackend::BatchMemcpy => vec![Call::Batch(
                self.block_pieces(layers, true)
                    .iter()
                    .map(|p| p.range(d))
                    .collect(),
            )],
        })
    }

    /// Stored layers of component index `c` that `layers` selects.
    fn stored_layers(&self, c: usize, layers: Layers) -> Vec<usize> {
        let model = &self.device.components()[c].model_layers;
        match layers {
            Layers::All => (0..model.len()).collect(),
            Layers::One(m) => model.iter().position(|&x| x == m).into_iter().collect(),
        }
    }

    /// Few, large pieces: runs coalesced, and all layers of a run stacked into one 2D copy where
    /// the device layer stride is uniform and every pitch is one a 2D copy accepts.
    fn coalesced_pieces(&self, layers: Layers) -> Result<Vec<Piece>> {
        let mut out = Vec::new();
        for (c, comp) in self.device.components().iter().enumerate() {
            let selected = self.stored_layers(c, layers);
            let s = self.host.block_side(c);
            let host_layer_stride = self.host.strides(c)?.layer_stride;
            let block = comp.block_bytes as u64;
            let all_layers = selected.len() == comp.layers() && comp.layers() > 1;
            let stack_pitch = self
                .device
                .layer_stride(c)
                .filter(|&stride| stride <= MAX_2D_PITCH && host_layer_stride <= MAX_2D_PITCH);
            let rows_contiguous = comp.rows == 1 || s.row_stride == comp.row_bytes as u64;
            let height = comp.layers() as u64;
            for run in self.plan.runs() {
                let dev = |l: usize, page: u64| self.device.layer_base(c, l) + page * block;
                let host = |l: usize, page: u64| self.host.layer_base(c, l) + page * s.page_stride;
                match (rows_contiguous, s.page_stride == block, stack_pitch) {
                    // layer_first: the run's pages are contiguous in each layer.
                    (true, true, Some(pitch)) if all_layers => out.push(Piece {
                        device: dev(0, run.device),
                        device_pitch: pitch,
                        host: host(0, run.host),
                        host_pitch: host_layer_stride,
                        width: run.pages * block,
                        height,
                    }),
                    (true, true, _) => out.extend(selected.iter().map(|&l| {
                        Piece::contiguous(dev(l, run.device), host(l, run.host), run.pages * block)
                    })),
                    // Page-major blocks: a page of every layer is contiguous on the host.
                    (true, false, Some(pitch)) if all_layers && run.pages <= height => {
                        out.extend((0..run.pages).map(|j| Piece {
                            device: dev(0, run.device + j),
                            device_pitch: pitch,
                            host: host(0, run.host + j),
                            host_pitch: host_layer_stride,
                            width: block,
                            height,
                        }))
                    }
                    (true, false, _) => out.extend(selected.iter().map(|&l| {
                        Piece {
                            device: dev(l, run.device),
                            device_pitch: block,
                            host: host(l, run.host),
                            host_pitch: s.page_stride,
                            width: block,
                            height: run.pages,
                        }
                        .folded()
                    })),
                    // Token-major rows: one 2D copy of the run's rows per layer.
                    (false, _, _) => out.extend(selected.iter().map(|&l| Piece {
                        device: dev(l, run.device),
                        device_pitch: comp.row_bytes as u64,
                        host: host(l, run.host),
                        host_pitch: s.row_stride,
                        width: comp.row_bytes as u64,
                        height: run.pages * comp.rows as u64,
                    })),
                }
            }
        }
        Ok(out)
    }

    /// One piece per (page, layer, component) block, layer by layer; a token-major block is a
    /// 2D piece of its rows, or (`split_rows`) one piece per row.
    fn block_pieces(&self, layers: Layers, split_rows: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        let components = self.device.components();
        let per_component: Vec<Vec<usize>> = (0..components.len())
            .map(|c| self.stored_layers(c, layers))
            .collect();
        for m in 0..self.model_layers {
            for (c, comp) in components.iter().enumerate() {
                let Some(&l) = per_component[c]
                    .iter()
                    .find(|&&l| comp.model_layers[l] == m)
                else {
                    continue;
                };
                let s = self.host.block_side(c);
                let block = comp.block_bytes as u64;
                let row = comp.row_bytes as u64;
                let rows_contiguous = comp.rows == 1 || s.row_stride == row;
                for (&dp, &hp) in self.plan.device_pages().iter().zip(self.plan.host_pages()) {
                    let dev = self.device.layer_base(c, l) + dp * block;
                    let host = self.host.layer_base(c, l) + hp * s.page_stride;
                    if rows_contiguous {
                        out.push(Piece::contiguous(dev, host, block));
                    } else if split_rows {
                        out.extend((0..comp.rows as u64).map(|r| {
                            Piece::contiguous(dev + r * row, host + r * s.row_stride, row)
                        }));
                    } else {
                        out.push(Piece {
                            device: dev,
                            device_pitch: row,
                            host,
                            host_pitch: s.row_stride,
                            width: row,
                            height: comp.rows as u64,
                        });
                    }
                }
            }
        }
        out
    }

    fn submit<B: Backend>(&self, backend: &B, call: Call, signals: u64) -> Result<()> {
        // SAFETY (every arm): addresses come from the two pools this transfer borrows, at local
        // pages the plan checked against both pools' page counts (BlockCopyPlan::new in `new`)
        // and stored layers of each component; piece widths and heights stay inside one layer
        // buffer (device) or one component buffer (host).
        match call {
            Call::Memcpy(c) => unsafe { backend.memcpy(c.dst, c.src, c.width as usize) },
            Call::Memcpy2d(c) => unsafe { backend.memcpy_2d(&c) },
            Call::Batch(ranges) => unsafe { backend.memcpy_batch(&ranges) },
            Call::Kernel { pairs, ctas } => {
                let tables = self.tables.as_ref().ok_or_else(|| {
                    Error::HiCache(
                        "the SM kernel backend needs HostTransfer::prepare_kernel first".into(),
                    )
                })?;
                let n = self.plan.len() as u64;
                let pairs_end = tables.addr() + (PAIR_BYTES * self.pairs.len()) as u64;
                let list = abi::kvs_page_list::local;
                let device = list(pairs_end, self.device.pages());
                let host = list(pairs_end + 8 * n, self.host.pages());
                let (src_pages, dst_pages) = match self.direction {
                    Direction::Load => (host, device),
                    Direction::Backup => (device, host),
                };
                let params = abi::kvs_copy_blocks_params {
                    components: self.kernel_components,
                    pairs: tables.addr() + (PAIR_BYTES * pairs.start) as u64,
                    num_pages: n,
                    src_pages,
                    dst_pages,
                    signals,
                    num_pairs: pairs.len() as u32,
                    num_components: self.num_components,
                    work: abi::kvs_work_queue::default(),
                    status: abi::kvs_status::default(),
                };
                // The pair table and page lists live in `tables`, which this transfer owns;
                // `signals` is 0 or the
                // counters of a LayerSignals sized to the model layers (run_signalled).
                unsafe { backend.copy_blocks(params, Launch::host_io(ctas)) }
            }
        }
    }
}

/// How [`HostTransfer::run_staged`] moves pages between its device staging and the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Relayout {
    /// `kvs_copy_blocks` with `ctas` 1024-thread CTAs: any layout, at HBM speed, but it takes
    /// SMs from the forward pass while it runs.
    Kernel {
        /// CTAs per launch.
        ctas: u32,
    },
    /// Device-to-device 2D copies on the copy engine, one per (page, component): no SM at all;
    /// needs kvshard-allocated pools (uniform layer stride) and whole blocks on the host side
    /// (`layer_first` or `page_first_direct`).
    CopyEngine,
}

/// Device staging for [`HostTransfer::run_staged`]: two device buffers laid out like the host
/// pool for `chunk` pages each, and the pair tables that address them.
#[derive(Debug)]
pub struct StagedIo {
    /// What the pair tables were built for: the direction, the device pool (its first layer's
    /// base) and the host layout the mirrors copy.
    made_for: (Direction, u64, HostLayout),
    chunk: u64,
    mirrors: [HostPool; 2],
    /// Per mirror: a `kvs_layer_pair` table (device side, mirror side) in transfer direction.
    tables: [Buffer; 2],
    num_pairs: u32,
}

impl StagedIo {
    /// Pages each staging buffer holds.
    pub fn chunk_pages(&self) -> u64 {
        self.chunk
    }

    /// Device bytes the two staging buffers take.
    pub fn bytes(&self) -> usize {
        self.mirrors.iter().map(HostPool::bytes).sum()
    }
}

impl Relayout {
    /// Refuses a relayout these pools cannot take, a property of the pools alone, so callers
    /// can check it before planning anything: the kernel needs at least one CTA; the copy
    /// engine needs every device layer at one stride a 2D copy accepts and blocks that are whole
    /// on both sides (not token-major `page_first` rows).
    pub(crate) fn check(self, device: &DevicePool, host: &HostPool) -> Result<()> {
        match self {
            Relayout::CopyEngine => check_copy_engine_relayout(device, host),
            Relayout::Kernel { ctas } => Launch::host_io(ctas).validate(1024),
        }
    }
}

fn check_copy_engine_relayout(device: &DevicePool, host: &HostPool) -> Result<()> {
    for (c, comp) in device.components().iter().enumerate() {
        let uniform =
            comp.layers() == 1 || device.layer_stride(c).is_some_and(|s| s <= MAX_2D_PITCH);
        let whole = comp.rows == 1 || host.block_side(c).row_stride == comp.row_bytes as u64;
        if !uniform || !whole {
            return Err(Error::HiCache(format!(
                "copy-engine relayout of {}: needs a uniform device layer stride and whole blocks in the {} host layout",
                comp.component,
                host.layout()
            )));
        }
    }
    Ok(())
}

/// A stretch of plan entries whose host pages are consecutive (one copy-engine run per
/// component on the host side); the device pages may be anything.
struct Segment {
    first_entry: usize,
    pages: u64,
    host_page: u64,
}

impl HostTransfer<'_> {
    /// Allocates the double-buffered device staging for [`HostTransfer::run_staged`], `chunk`
    /// pages per buffer, and uploads its pair tables.
    pub fn staging<B: Backend>(&self, backend: &B, chunk: u64) -> Result<StagedIo> {
        if chunk == 0 {
            return Err(Error::InvalidArgument("staging of 0 pages".into()));
        }
        let mirrors = [
            HostPool::device_mirror(backend, self.host, chunk)?,
            HostPool::device_mirror(backend, self.host, chunk)?,
        ];
        let mut tables = Vec::with_capacity(2);
        let mut num_pairs = 0;
        for mirror in &mirrors {
            let mut pairs = Vec::new();
            for (c, comp) in self.device.components().iter().enumerate() {
                for (l, &model_layer) in comp.model_layers.iter().enumerate() {
                    let (src, dst) = match self.direction {
                        Direction::Load => (mirror.layer_base(c, l), self.device.layer_base(c, l)),
                        Direction::Backup => {
                            (self.device.layer_base(c, l), mirror.layer_base(c, l))
                        }
                    };
                    pairs.push(abi::kvs_layer_pair {
                        src,
                        dst,
                        component: c as u32,
                        signal: model_layer as u32,
                    });
                }
            }
            num_pairs = pairs.len() as u32;
            let mut bytes = Vec::with_capacity(24 * pairs.len());
            crate::backend::extend_pair_table(&mut bytes, &pairs);
            let table = backend.alloc(bytes.len(), MemoryKind::Device)?;
            backend.write(&table, 0, &bytes)?;
            tables.push(table);
        }
        let [t0, t1]: [Buffer; 2] = tables.try_into().expect("two tables");
        Ok(StagedIo {
            made_for: self.staging_key(),
            chunk,
            mirrors,
            tables: [t0, t1],
            num_pairs,
        })
    }

    fn staging_key(&self) -> (Direction, u64, HostLayout) {
        let device = self.device.layer_bases(0).first().copied().unwrap_or(0);
        (self.direction, device, self.host.layout())
    }

    /// 2D copies between a mirror and the device pool for one segment: per (page, component)
    /// one copy whose rows are the component's layers.
    fn relayout_copies(&self, seg: &Segment, mirror: &HostPool) -> Result<Vec<Call>> {
        let mut calls = Vec::new();
        for (c, comp) in self.device.components().iter().enumerate() {
            let block = comp.block_bytes as u64;
            let m = mirror.strides(c)?;
            let device_pitch = self.device.layer_stride(c).unwrap_or(block);
            for j in 0..seg.pages {
                let dev_page = self.plan.device_pages()[seg.first_entry + j as usize];
                let piece = Piece {
                    device: self.device.layer_base(c, 0) + dev_page * block,
                    device_pitch,
                    host: mirror.layer_base(c, 0) + j * m.page_stride,
                    host_pitch: m.layer_stride,
                    width: block,
                    height: comp.layers() as u64,
                };
                calls.push(if piece.height > 1 {
                    Call::Memcpy2d(piece.copy(self.direction))
                } else {
                    Call::Memcpy(piece.copy(self.direction))
                });
            }
        }
        Ok(calls)
    }

    /// The plan's entries cut where host pages stop being consecutive or a chunk is full.
    fn segments(&self, chunk: u64) -> Vec<Segment> {
        let mut out: Vec<Segment> = Vec::new();
        for (j, &hp) in self.plan.host_pages().iter().enumerate() {
            match out.last_mut() {
                Some(s) if s.pages < chunk && s.host_page + s.pages == hp => s.pages += 1,
                _ => out.push(Segment {
                    first_entry: j,
                    pages: 1,
                    host_page: hp,
                }),
            }
        }
        out
    }

    /// Copy-engine copies of one segment between the host pool and a mirror: per component one
    /// contiguous run (page-major layouts) or one 2D copy over the layers (`layer_first`).
    fn mirror_copies(&self, seg: &Segment, mirror: &HostPool) -> Result<Vec<Call>> {
        let mut calls = Vec::new();
        for (c, comp) in self.device.components().iter().enumerate() {
            let (host, dev) = (self.host.strides(c)?, mirror.strides(c)?);
            let host_at = self.host.layer_base(c, 0) + seg.host_page * host.page_stride;
            let mirror_at = mirror.layer_base(c, 0);
            let piece = if self.host.layout() == HostLayout::LayerFirst {
                let width = seg.pages * comp.block_bytes as u64;
                Piece {
                    device: mirror_at,
                    device_pitch: dev.layer_stride,
                    host: host_at,
                    host_pitch: host.layer_stride,
                    width,
                    height: comp.layers() as u64,
                }
            } else {
                Piece::contiguous(mirror_at, host_at, seg.pages * comp.page_bytes() as u64)
            };
            if piece.height > 1 && piece.host_pitch > MAX_2D_PITCH {
                calls.extend((0..comp.layers() as u64).map(|l| {
                    Call::Memcpy(
                        Piece::contiguous(
                            piece.device + l * piece.device_pitch,
                            piece.host + l * piece.host_pitch,
                            piece.width,
                        )
                        .copy(self.direction),
                    )
                }));
            } else if piece.height > 1 {
                calls.push(Call::Memcpy2d(piece.copy(self.direction)));
            } else {
                calls.push(Call::Memcpy(piece.copy(self.direction)));
            }
        }
        Ok(calls)
    }

    /// Every layer through device staging: the copy engine moves host runs of up to
    /// `staging.chunk_pages()` pages as a few large contiguous copies on `copy`'s stream, and
    /// `kvs_copy_blocks` (`ctas` CTAs) places or gathers the scattered device pages on
    /// `relayout`'s stream, double-buffered so that both overlap. Everything is ordered after
    /// what `copy`'s stream held when this was called, and when `copy`'s stream reaches the end
    /// of what this enqueues, the whole transfer has landed and `staging` may be reused.
    pub fn run_staged<B: Backend>(
        &self,
        copy: &B,
        relayout: &B,
        staging: &StagedIo,
        how: Relayout,
    ) -> Result<()> {
        how.check(self.device, self.host)?;
        if staging.made_for != self.staging_key() {
            let (direction, _, layout) = staging.made_for;
            return Err(Error::HiCache(format!(
                "staging made for a {direction:?} between another device pool or a {layout} host and this {:?}",
                self.direction
            )));
        }
        if self.plan.is_empty() {
            return Ok(());
        }
        let tables = self.tables.as_ref().ok_or_else(|| {
            Error::HiCache("the staged backend needs HostTransfer::prepare_kernel first".into())
        })?;
        let device_ids = tables.addr() + (PAIR_BYTES * self.pairs.len()) as u64;
        // The relayout stream starts after everything enqueued on `copy` so far: the caller's
        // ordering (a backup's compute event) and an earlier run through the same staging.
        relayout.wait(&copy.record()?)?;
        // Per staging buffer: the event after which it may be refilled.
        let mut free: [Option<B::Event>; 2] = [None, None];
        for (i, seg) in self.segments(staging.chunk).iter().enumerate() {
            let m = i % 2;
            let mirror = &staging.mirrors[m];
            let device_list = abi::kvs_page_list::local(
                device_ids + 8 * seg.first_entry as u64,
                self.device.pages(),
            );
            let mirror_list = abi::kvs_page_list::positions(staging.chunk);
            let (src_pages, dst_pages) = match self.direction {
                Direction::Load => (mirror_list, device_list),
                Direction::Backup => (device_list, mirror_list),
            };
            let kernel = abi::kvs_copy_blocks_params {
                components: self.kernel_components,
                pairs: staging.tables[m].addr(),
                num_pages: seg.pages,
                src_pages,
                dst_pages,
                signals: 0,
                num_pairs: staging.num_pairs,
                num_components: self.num_components,
                work: abi::kvs_work_queue::default(),
                status: abi::kvs_status::default(),
            };
            // Between the mirror and the device pool: one launch, or 2D copies page by page.
            let place = |stream: &B| -> Result<()> {
                match how {
                    // SAFETY: the mirror holds `chunk` >= seg.pages pages of every stored layer
                    // (pair table built from it); device ids are this plan's checked local pages.
                    Relayout::Kernel { ctas } => unsafe {
                        stream.copy_blocks(kernel, Launch::host_io(ctas))
                    },
                    Relayout::CopyEngine => self
                        .relayout_copies(seg, mirror)?
                        .into_iter()
                        .try_for_each(|call| self.submit(stream, call, 0)),
                }
            };
            match self.direction {
                Direction::Load => {
                    if let Some(e) = &free[m] {
                        copy.wait(e)?;
                    }
                    for call in self.mirror_copies(seg, mirror)? {
                        self.submit(copy, call, 0)?;
                    }
                    relayout.wait(&copy.record()?)?;
                    place(relayout)?;
                    free[m] = Some(relayout.record()?);
                }
                Direction::Backup => {
                    if let Some(e) = &free[m] {
                        relayout.wait(e)?;
                    }
                    place(relayout)?;
                    copy.wait(&relayout.record()?)?;
                    for call in self.mirror_copies(seg, mirror)? {
                        self.submit(copy, call, 0)?;
                    }
                    free[m] = Some(copy.record()?);
                }
            }
        }
        // Loads end on the relayout stream: make `copy` reach the end only after both buffers'
        // last relayouts (backups end on `copy` already).
        for event in free.iter().flatten() {
            copy.wait(event)?;
        }
        Ok(())
    }
}
