//! Block copies between block spaces: the only place a `kvs_copy_blocks_params` and its pair
//! table are built. Gathers and scatters between pools and staging, P/D sends into a decode
//! pool, and HiCache's kernel paths (direct, signalled, staged relayouts) all describe what
//! moves as a [`BlockCopyPlan`] and run it here.
//!
//! A plan is plain data with private fields, checked in full against both spaces when it is
//! built (every page in range, destinations distinct, same components) and immutable after.
//! It remembers the identity of the two spaces; [`BlockCopy::prepare_sync`] takes shared
//! ownership of exactly those spaces (anything else is refused), so the memory a launch
//! touches stays allocated while the copy can run.

use std::collections::VecDeque;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use super::signals::{CounterWait, LayerSignals};
use super::space::{check_same_components, BlockSpace, SpaceId};
use crate::abi;
use crate::backend::{
    check_space, ordered, AddressSpace, Backend, Buffer, Event, Launch, MemoryKind, Usage,
};
use crate::error::{Error, Result};
use crate::geometry::Component;
use crate::index::{LocalPage, LogicalPage, ModelLayer};
use crate::shard::Placement;

/// Bytes of one `kvs_layer_pair` in a table.
const PAIR_BYTES: usize = std::mem::size_of::<abi::kvs_layer_pair>();

/// Which page of one side entry `j` of a copy addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PageSelection {
    /// Entry `j` is page `j` (a staging buffer filled in entry order).
    Positions,
    /// Entry `j` is local page `pages[j]` of the space.
    Local(Vec<LocalPage>),
    /// Entry `j` is logical page `pages[j]`: it moves only if `rank` owns it, to its local page
    /// `pages[j] / N`. Reserved pages `0..N` are refused.
    Logical {
        /// Logical pages.
        pages: Vec<LogicalPage>,
        /// Sharding of the pages.
        placement: Placement,
        /// The rank whose pages move.
        rank: u32,
    },
}

/// One side's checked page selection and the bound its pages respect.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PageList {
    selection: PageSelection,
    limit: u64,
}

impl PageList {
    fn new(
        selection: PageSelection,
        space: &dyn BlockSpace,
        entries: usize,
        side: &'static str,
        distinct: bool,
    ) -> Result<Self> {
        let limit = space.pages();
        match &selection {
            // Checked per launch: a staged transfer runs a long plan in windows of at most
            // `limit` entries (BlockCopy::run_entries).
            PageSelection::Positions => {}
            PageSelection::Local(pages) => {
                check_len(pages.len(), entries, side)?;
                if let Some(bad) = pages.iter().find(|p| p.0 >= limit) {
                    return Err(Error::OutOfRange {
                        what: "local page",
                        index: i64::try_from(bad.0).unwrap_or(i64::MAX),
                        limit,
                    });
                }
                if distinct {
                    check_distinct(pages.iter().map(|p| p.0), side)?;
                }
            }
            PageSelection::Logical {
                pages,
                placement,
                rank,
            } => {
                check_len(pages.len(), entries, side)?;
                placement.check_rank(*rank)?;
                let logical = placement.logical_pages(limit)?;
                for &page in pages {
                    if page.0 >= logical {
                        return Err(Error::OutOfRange {
                            what: "logical page",
                            index: i64::try_from(page.0).unwrap_or(i64::MAX),
                            limit: logical,
                        });
                    }
                    if placement.is_reserved(page) {
                        return Err(Error::ReservedPage {
                            page: page.0,
                            shard: placement.shard(),
                        });
                    }
                }
                if distinct {
                    check_distinct(pages.iter().map(|p| p.0), side)?;
                }
            }
        }
        Ok(Self { selection, limit })
    }

    /// Whether entry `j` moves as far as this side is concerned.
    fn moves(&self, j: usize) -> bool {
        match &self.selection {
            PageSelection::Positions | PageSelection::Local(_) => true,
            PageSelection::Logical {
                pages,
                placement,
                rank,
            } => placement.owner(pages[j]) == *rank,
        }
    }

    /// The kernel's view of this list, its ids at `ids` (0 when it has none).
    fn abi(&self, ids: u64) -> abi::kvs_page_list {
        let (kind, shard, rank) = match &self.selection {
            PageSelection::Positions => (abi::KVS_INDEX_POSITION, 1, 0),
            PageSelection::Local(_) => (abi::KVS_INDEX_LOCAL, 1, 0),
            PageSelection::Logical {
                placement, rank, ..
            } => (abi::KVS_INDEX_LOGICAL, placement.shard(), *rank),
        };
        abi::kvs_page_list {
            ids,
            limit: self.limit,
            kind,
            shard,
            rank,
            reserved: 0,
        }
    }

    /// The ids the kernel reads, as little-endian int64s appended to `out`.
    fn extend_ids(&self, out: &mut Vec<u8>) {
        match &self.selection {
            PageSelection::Positions => {}
            // Pages were checked below the space's page count, itself far below 2^63.
            PageSelection::Local(pages) => {
                out.extend(pages.iter().flat_map(|p| (p.0 as i64).to_le_bytes()))
            }
            PageSelection::Logical { pages, .. } => {
                out.extend(pages.iter().flat_map(|p| (p.0 as i64).to_le_bytes()))
            }
        }
    }

    fn has_ids(&self) -> bool {
        !matches!(self.selection, PageSelection::Positions)
    }
}

fn check_len(got: usize, entries: usize, side: &str) -> Result<()> {
    if got != entries {
        return Err(Error::InvalidArgument(format!(
            "{side}: {got} pages for {entries} entries"
        )));
    }
    Ok(())
}

/// Refuses a page listed twice: two entries would write one block, racing on the GPU, and one
/// position's data would be lost. Sorts (page, position) pairs: no hashing on the hot path of
/// planning every chunk.
pub(crate) fn check_distinct(pages: impl Iterator<Item = u64>, what: &'static str) -> Result<()> {
    let mut sorted: Vec<(u64, usize)> = pages.enumerate().map(|(i, p)| (p, i)).collect();
    sorted.sort_unstable();
    match sorted.windows(2).find(|w| w[0].0 == w[1].0) {
        Some(w) => Err(Error::DuplicatePage {
            what,
            page: w[0].0,
            first: w[0].1,
            second: w[1].1,
        }),
        None => Ok(()),
    }
}

/// A block copy as plain data: what moves where, checked against both spaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockCopyPlan {
    src: (SpaceId, AddressSpace),
    dst: (SpaceId, AddressSpace),
    /// Model layers of the cache (the index space of signals).
    model_layers: usize,
    /// Per component index of the spaces: rows and strides on each side (rows merged when both
    /// sides are contiguous, so the kernel's hot path has no division).
    components: Vec<abi::kvs_block_component>,
    /// Bytes of one block of each component.
    block_bytes: Vec<u64>,
    /// Every (component, layer) moved; `signal` is the model layer.
    pairs: Vec<abi::kvs_layer_pair>,
    entries: usize,
    src_pages: PageList,
    dst_pages: PageList,
    moved: usize,
}

impl BlockCopyPlan {
    /// Plans copying `entries` pages of every component and layer from `src` to `dst`, pairs in
    /// component-then-layer order. Every page is checked against its space; destination pages
    /// must be distinct.
    pub fn new(
        src: &dyn BlockSpace,
        src_pages: PageSelection,
        dst: &dyn BlockSpace,
        dst_pages: PageSelection,
        entries: usize,
    ) -> Result<Self> {
        check_same_components(src.components(), dst.components())?;
        let src_pages = PageList::new(src_pages, src, entries, "source", false)?;
        let dst_pages = PageList::new(dst_pages, dst, entries, "destination", true)?;
        let mut components = Vec::new();
        let mut block_bytes = Vec::new();
        let mut pairs = Vec::new();
        let mut model_layers = 0;
        for (c, layout) in src.components().iter().enumerate() {
            let (s, d) = (src.side(c), dst.side(c));
            let row = layout.row_bytes as u64;
            let contiguous = s.row_stride == row && d.row_stride == row;
            components.push(abi::kvs_block_component {
                rows: if contiguous { 1 } else { layout.rows as u32 },
                row_bytes: if contiguous {
                    layout.block_bytes
                } else {
                    layout.row_bytes
                } as u32,
                src: s,
                dst: d,
            });
            block_bytes.push(layout.block_bytes as u64);
            for (l, &model_layer) in layout.model_layers.iter().enumerate() {
                model_layers = model_layers.max(model_layer.0 + 1);
                pairs.push(abi::kvs_layer_pair {
                    src: src.base(c, l),
                    dst: dst.base(c, l),
                    component: c as u32,
                    signal: model_layer.0 as u32,
                });
            }
        }
        let moved = (0..entries)
            .filter(|&j| src_pages.moves(j) && dst_pages.moves(j))
            .count();
        Ok(Self {
            src: (src.id(), src.address_space()),
            dst: (dst.id(), dst.address_space()),
            model_layers,
            components,
            block_bytes,
            pairs,
            entries,
            src_pages,
            dst_pages,
            moved,
        })
    }

    /// Keeps only the pairs of `components` (a P/D section: the latent KV, or the indexer
    /// state).
    pub fn only_components(mut self, src: &dyn BlockSpace, components: &[Component]) -> Self {
        let keep: Vec<bool> = src
            .components()
            .iter()
            .map(|c| components.contains(&c.component))
            .collect();
        self.pairs
            .retain(|p| keep.get(p.component as usize).copied().unwrap_or(false));
        self
    }

    /// Orders the pairs layer by layer (model layer 0's pairs first), so a launch finishes the
    /// layers roughly in order and each layer's pairs are one range ([`Self::layer_pairs`]).
    pub fn layer_major(mut self) -> Self {
        self.pairs.sort_by_key(|p| p.signal);
        self
    }

    /// Makes the pairs of each model layer `m` count towards the ready signal of `f(m)` (a
    /// HiCache load signals the MTP draft's layer with target layer 0); orders and per-layer
    /// ranges follow the signal.
    pub fn map_signals(mut self, f: impl Fn(ModelLayer) -> ModelLayer) -> Self {
        for p in &mut self.pairs {
            let to = f(ModelLayer(p.signal as usize)).0;
            if to < self.model_layers {
                p.signal = to as u32;
            }
        }
        self
    }

    /// Keeps only the pairs of model layers `keep` accepts (one layer during its forward).
    pub fn retain_layers(mut self, keep: impl Fn(ModelLayer) -> bool) -> Self {
        self.pairs.retain(|p| keep(ModelLayer(p.signal as usize)));
        self
    }

    /// Entries (pages) of the copy.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Entries that actually move (owned on every logical side).
    pub fn moved_entries(&self) -> usize {
        self.moved
    }

    /// (component, layer) pairs each entry moves.
    pub fn pairs(&self) -> usize {
        self.pairs.len()
    }

    /// Bytes of one entry across every pair.
    pub fn entry_bytes(&self) -> u64 {
        self.pairs
            .iter()
            .map(|p| self.block_bytes[p.component as usize])
            .sum()
    }

    /// Bytes the copy moves (each moved byte is read once and written once).
    pub fn bytes(&self) -> u64 {
        self.moved as u64 * self.entry_bytes()
    }

    /// The range of pairs of each model layer (empty for a layer the copy does not move); the
    /// ranges are exact once the plan is [`Self::layer_major`].
    pub fn layer_pairs(&self) -> Vec<Range<usize>> {
        let mut out = vec![0..0; self.model_layers];
        for (k, p) in self.pairs.iter().enumerate() {
            let r = &mut out[p.signal as usize];
            if r.start == r.end {
                *r = k..k + 1;
            } else {
                r.end = k + 1;
            }
        }
        out
    }

    /// Units each ready signal counts once the copy is done: per model layer,
    /// `entries x pairs of that layer` (every unit counts, moved or skipped).
    pub fn signal_units(&self) -> Result<Vec<u32>> {
        let mut t = vec![0u32; self.model_layers];
        for p in &self.pairs {
            let slot = &mut t[p.signal as usize];
            *slot = u32::try_from(self.entries)
                .ok()
                .and_then(|e| slot.checked_add(e))
                .filter(|&units| units < 1 << 31)
                .ok_or_else(|| {
                    Error::overflow(format!(
                        "ready-counter units of model layer {} ({} entries)",
                        p.signal, self.entries
                    ))
                })?;
        }
        Ok(t)
    }

    /// Model layers of the cache the plan was made for.
    pub fn model_layers(&self) -> usize {
        self.model_layers
    }

    /// Bytes of device memory the plan's tables take (the pair table, then the id lists).
    pub fn table_bytes(&self) -> usize {
        let ids = usize::from(self.src_pages.has_ids()) + usize::from(self.dst_pages.has_ids());
        PAIR_BYTES * self.pairs.len() + 8 * ids * self.entries
    }

    /// The pair table, then the source ids, then the destination ids, as the kernel reads them;
    /// and the offsets of the two id lists in it.
    fn tables(&self) -> (Vec<u8>, u64, u64) {
        let mut bytes = Vec::with_capacity(PAIR_BYTES * self.pairs.len() + 16 * self.entries);
        for p in &self.pairs {
            bytes.extend_from_slice(&p.src.to_le_bytes());
            bytes.extend_from_slice(&p.dst.to_le_bytes());
            bytes.extend_from_slice(&p.component.to_le_bytes());
            bytes.extend_from_slice(&p.signal.to_le_bytes());
        }
        let src_at = bytes.len() as u64;
        self.src_pages.extend_ids(&mut bytes);
        let dst_at = bytes.len() as u64;
        self.dst_pages.extend_ids(&mut bytes);
        (bytes, src_at, dst_at)
    }

    /// The launch parameters, tables at `tables`, for pairs `pairs` and entries `entries`.
    fn params(
        &self,
        tables: u64,
        (src_at, dst_at): (u64, u64),
        pairs: Range<usize>,
        entries: Range<usize>,
        signals: u64,
    ) -> abi::kvs_copy_blocks_params {
        let mut components =
            [abi::kvs_block_component::default(); abi::KVS_MAX_COMPONENTS as usize];
        components[..self.components.len()].copy_from_slice(&self.components);
        let list = |list: &PageList, at: u64| {
            let ids = if list.has_ids() {
                tables + at + 8 * entries.start as u64
            } else {
                0
            };
            list.abi(ids)
        };
        abi::kvs_copy_blocks_params {
            components,
            pairs: tables + (PAIR_BYTES * pairs.start) as u64,
            num_pages: entries.len() as u64,
            src_pages: list(&self.src_pages, src_at),
            dst_pages: list(&self.dst_pages, dst_at),
            signals,
            num_pairs: pairs.len() as u32,
            num_components: self.components.len() as u32,
            work: abi::kvs_work_queue::default(),
            status: abi::kvs_status::default(),
        }
    }

    /// Checks a launch of `entries` entries fits every positions side (position `j` of a launch
    /// is page `j`).
    fn check_window(&self, entries: usize) -> Result<()> {
        for list in [&self.src_pages, &self.dst_pages] {
            if !list.has_ids() && entries as u64 > list.limit {
                return Err(Error::OutOfRange {
                    what: "staging position",
                    index: entries as i64 - 1,
                    limit: list.limit,
                });
            }
        }
        Ok(())
    }

    /// Checks `src` and `dst` are the spaces this plan was made for, and that `backend` runs in
    /// their address space.
    fn check_spaces(
        &self,
        backend: &dyn Backend,
        src: &dyn BlockSpace,
        dst: &dyn BlockSpace,
    ) -> Result<()> {
        for (side, (id, _), space) in [("source", self.src, src), ("destination", self.dst, dst)] {
            if space.id() != id {
                return Err(Error::InvalidArgument(format!(
                    "copy planned for {side} {id} used with {}",
                    space.id()
                )));
            }
            check_space(backend.address_space(), space.address_space(), side)?;
        }
        Ok(())
    }
}

impl fmt::Display for BlockCopyPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} entries ({} move) x {} layer pairs, {} bytes",
            self.entries,
            self.moved,
            self.pairs.len(),
            self.bytes()
        )
    }
}

/// Device memory holding a prepared copy's tables. Only kvshard makes these, so a copy's
/// tables can never be a caller's buffer (a slice of the KV pool, say); a finished copy hands
/// its tables back ([`BlockCopy::into_tables`]) for reuse by the next.
#[derive(Debug)]
pub struct TableBuffer(Buffer);

impl TableBuffer {
    /// Bytes it holds.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A plan uploaded to one backend, ready to run repeatedly. It holds the two spaces it copies
/// between; every launch records itself on their usages and the tables', so dropping the copy,
/// or handing its tables to the next one ([`BlockCopy::into_tables`]), while runs are still
/// queued is safe: the memory stays until they have run, and a new upload into the tables is
/// ordered after them.
#[derive(Debug)]
pub struct BlockCopy {
    plan: BlockCopyPlan,
    src: Arc<dyn BlockSpace>,
    dst: Arc<dyn BlockSpace>,
    tables: Option<TableBuffer>,
    offsets: (u64, u64),
    layer_pairs: Vec<Range<usize>>,
}

impl BlockCopy {
    /// [`BlockCopy::prepare`], then waits for `backend`'s stream (the upload and whatever was
    /// queued before it).
    pub fn prepare_sync(
        backend: &dyn Backend,
        plan: BlockCopyPlan,
        src: Arc<dyn BlockSpace>,
        dst: Arc<dyn BlockSpace>,
        reuse: Option<TableBuffer>,
    ) -> Result<Self> {
        let copy = Self::prepare(backend, plan, src, dst, reuse)?;
        backend.synchronize()?;
        Ok(copy)
    }

    /// Enqueues the upload of `plan`'s tables on `backend`'s stream, without waiting, into
    /// `reuse` when it is large enough, else into a new allocation (rounded up to a power of
    /// two so later copies of similar size can reuse it). Runs on any stream are ordered after
    /// the upload, and an upload into reused tables after the runs still reading them (the
    /// tables' usage). `src` and `dst` must be the spaces the plan was made for, in `backend`'s
    /// address space.
    pub fn prepare(
        backend: &dyn Backend,
        plan: BlockCopyPlan,
        src: Arc<dyn BlockSpace>,
        dst: Arc<dyn BlockSpace>,
        reuse: Option<TableBuffer>,
    ) -> Result<Self> {
        plan.check_spaces(backend, src.as_ref(), dst.as_ref())?;
        let layer_pairs = plan.layer_pairs();
        let (bytes, src_at, dst_at) = plan.tables();
        let tables = if plan.pairs.is_empty() || plan.entries == 0 {
            None
        } else {
            let table = match reuse {
                Some(t) if t.0.len() >= bytes.len() && t.0.space() == backend.address_space() => t,
                _ => TableBuffer(
                    backend.alloc(
                        bytes
                            .len()
                            .checked_next_power_of_two()
                            .unwrap_or(bytes.len()),
                        MemoryKind::Device,
                    )?,
                ),
            };
            backend.enqueue_write(&table.0, 0, &bytes)?;
            Some(table)
        };
        Ok(Self {
            plan,
            src,
            dst,
            tables,
            offsets: (src_at, dst_at),
            layer_pairs,
        })
    }

    /// The plan.
    pub fn plan(&self) -> &BlockCopyPlan {
        &self.plan
    }

    /// Bytes one run of every pair moves.
    pub fn bytes(&self) -> u64 {
        self.plan.bytes()
    }

    /// The tables, for the next copy to reuse: an upload into them is ordered after the runs
    /// of this copy still queued.
    pub fn into_tables(self) -> Option<TableBuffer> {
        self.tables
    }

    fn launch(
        &self,
        backend: &dyn Backend,
        pairs: Range<usize>,
        entries: Range<usize>,
        launch: Launch,
        signals: Option<&Buffer>,
    ) -> Result<()> {
        self.plan.check_window(entries.len())?;
        check_space(
            backend.address_space(),
            self.src.address_space(),
            "copy source",
        )?;
        check_space(
            backend.address_space(),
            self.dst.address_space(),
            "copy destination",
        )?;
        let Some(tables) = &self.tables else {
            return Ok(());
        };
        if pairs.is_empty() || entries.is_empty() {
            return Ok(());
        }
        let params = self.plan.params(
            tables.0.addr(),
            self.offsets,
            pairs,
            entries,
            signals.map_or(0, Buffer::addr),
        );
        let reads = [self.src.usage(), tables.0.usage()];
        let mut writes = vec![self.dst.usage()];
        writes.extend(signals.map(Buffer::usage));
        ordered(backend, &reads, &writes, || {
            // SAFETY: the pairs are (component, layer) bases of the two spaces this copy holds,
            // checked to be the ones the plan was made for and to live in the backend's address
            // space; their usages (and the tables') keep the memory until the launch has run,
            // whatever is dropped or reused meanwhile, and order it after conflicting work of
            // other streams; every page the lists name was checked below its space's page
            // count, and the kernel re-checks them against the same limits; the tables are this
            // copy's own device memory, holding every pair and id the ranges name.
            unsafe { backend.copy_blocks(params, launch) }
        })
    }

    /// Enqueues the whole copy on `backend` with grid `launch`.
    pub fn run(&self, backend: &dyn Backend, launch: Launch) -> Result<()> {
        self.launch(
            backend,
            0..self.plan.pairs.len(),
            0..self.plan.entries,
            launch,
            None,
        )
    }

    /// Enqueues the pairs of model layer `layer` only (in a [`BlockCopyPlan::layer_major`]
    /// plan they are one range; otherwise the layer's first to last pair).
    pub fn run_layer(
        &self,
        backend: &dyn Backend,
        layer: ModelLayer,
        launch: Launch,
    ) -> Result<()> {
        let pairs = self
            .layer_pairs
            .get(layer.0)
            .cloned()
            .ok_or(Error::OutOfRange {
                what: "model layer",
                index: layer.0 as i64,
                limit: self.layer_pairs.len() as u64,
            })?;
        self.launch(backend, pairs, 0..self.plan.entries, launch, None)
    }

    /// Enqueues entries `entries` only (a segment of a staged transfer): entry `j` of the launch
    /// is entry `entries.start + j` of the plan, and a positions side addresses page `j`.
    pub fn run_entries(
        &self,
        backend: &dyn Backend,
        entries: Range<usize>,
        launch: Launch,
    ) -> Result<()> {
        if entries.start > entries.end || entries.end > self.plan.entries {
            return Err(Error::OutOfRange {
                what: "copy entry",
                index: entries.end as i64,
                limit: self.plan.entries as u64 + 1,
            });
        }
        self.launch(backend, 0..self.plan.pairs.len(), entries, launch, None)
    }

    /// Enqueues the whole copy, counting every finished unit into `signals`; returns, per model
    /// layer, the counter value that means that layer has landed. Layers land roughly in
    /// order, layer 0 first, in a [`BlockCopyPlan::layer_major`] plan.
    pub fn run_signalled(
        &self,
        backend: &dyn Backend,
        launch: Launch,
        signals: &mut LayerSignals,
    ) -> Result<Vec<CounterWait>> {
        if signals.layers() != self.plan.model_layers {
            return Err(Error::GeometryMismatch {
                what: "ready counters".into(),
                expected: self.plan.model_layers.to_string(),
                got: signals.layers().to_string(),
            });
        }
        backend.check(signals.counters(), "ready counters")?;
        let units = if self.tables.is_some() {
            self.plan.signal_units()?
        } else {
            vec![0; self.plan.model_layers]
        };
        self.launch(
            backend,
            0..self.plan.pairs.len(),
            0..self.plan.entries,
            launch,
            Some(signals.counters()),
        )?;
        Ok(signals.count(&units))
    }
}

/// What a one-shot launch needs kept alive until it has run: held, never read.
#[derive(Debug)]
enum Keep {
    Space(#[allow(dead_code)] Arc<dyn BlockSpace>),
    Table(#[allow(dead_code)] Buffer),
}

/// Reusable device memory for one-shot copies on one backend stream (a P/D chunk's block copy,
/// a range table): each upload is stream-ordered after the launches that read the previous
/// contents, so chunks need no synchronization between them. The store keeps the spaces of
/// every launch, and tables it outgrew, until the stream has passed the launch.
pub struct TableStore {
    backend: Arc<dyn Backend>,
    table: Option<Buffer>,
    inflight: VecDeque<(Event, Vec<Keep>)>,
}

impl fmt::Debug for TableStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TableStore")
            .field("backend", &self.backend.name())
            .field("bytes", &self.table.as_ref().map_or(0, Buffer::len))
            .field("inflight", &self.inflight.len())
            .finish()
    }
}

impl TableStore {
    /// A store launching on `backend`.
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        Self {
            backend,
            table: None,
            inflight: VecDeque::new(),
        }
    }

    /// The backend it launches on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Drops what launches the stream has passed kept alive.
    pub fn collect(&mut self) -> Result<()> {
        while let Some((event, _)) = self.inflight.front() {
            if !self.backend.is_done(event)? {
                break;
            }
            self.inflight.pop_front();
        }
        Ok(())
    }

    /// Uploads `bytes` (stream-ordered, no wait) and returns their device address; a table it
    /// outgrew joins `keep`.
    fn upload(&mut self, bytes: &[u8], keep: &mut Vec<Keep>) -> Result<u64> {
        let table = match self.table.take() {
            Some(t) if t.len() >= bytes.len() => t,
            old => {
                keep.extend(old.map(Keep::Table));
                let want = bytes.len().max(64 << 10);
                self.backend.alloc(
                    want.checked_next_power_of_two().unwrap_or(want),
                    MemoryKind::Device,
                )?
            }
        };
        let written = self.backend.enqueue_write(&table, 0, bytes);
        let addr = table.addr();
        self.table = Some(table);
        written.map(|()| addr)
    }

    /// Uploads `plan`'s tables and launches it once. `src` and `dst` must be the plan's spaces,
    /// in the store's address space; they are kept until the launch has run.
    pub fn launch(
        &mut self,
        plan: &BlockCopyPlan,
        src: &Arc<dyn BlockSpace>,
        dst: &Arc<dyn BlockSpace>,
        launch: Launch,
    ) -> Result<()> {
        plan.check_spaces(self.backend.as_ref(), src.as_ref(), dst.as_ref())?;
        if plan.pairs.is_empty() || plan.entries == 0 {
            return Ok(());
        }
        plan.check_window(plan.entries)?;
        self.collect()?;
        let mut keep = vec![Keep::Space(src.clone()), Keep::Space(dst.clone())];
        let (bytes, src_at, dst_at) = plan.tables();
        let tables = self.upload(&bytes, &mut keep)?;
        let params = plan.params(
            tables,
            (src_at, dst_at),
            0..plan.pairs.len(),
            0..plan.entries,
            0,
        );
        let table = self.table.as_ref().map(Buffer::usage);
        let reads: Vec<&Usage> = [src.usage()].into_iter().chain(table).collect();
        ordered(self.backend.as_ref(), &reads, &[dst.usage()], || {
            // SAFETY: as in BlockCopy::launch: the spaces are the plan's, in the backend's
            // address space, and kept alive below (and by their usages) until the stream has
            // passed the launch; the tables were just uploaded, in stream order, into this
            // store's memory, which a later upload rewrites only after this launch in stream
            // order (one backend, one stream).
            unsafe { self.backend.copy_blocks(params, launch) }
        })?;
        self.inflight.push_back((self.backend.record()?, keep));
        Ok(())
    }

    /// Uploads `ranges` (already checked to lie inside `spaces`) and launches
    /// `kvs_copy_ranges` over them once; `spaces` are kept until the launch has run. The only
    /// builder of `kvs_copy_ranges_params`: a range longer than the kernel takes
    /// ([`abi::KVS_COPY_RANGE_MAX_BYTES`]) is an [`Error::InvalidArgument`] before anything is
    /// uploaded or launched (callers cut ranges far shorter, `transfer::kernel_pieces`).
    pub(crate) fn launch_ranges(
        &mut self,
        ranges: &[abi::kvs_range],
        spaces: [&Arc<dyn BlockSpace>; 2],
        launch: Launch,
    ) -> Result<()> {
        if ranges.is_empty() {
            return Ok(());
        }
        if let Some((i, r)) = ranges
            .iter()
            .enumerate()
            .find(|(_, r)| r.bytes > abi::KVS_COPY_RANGE_MAX_BYTES)
        {
            return Err(Error::InvalidArgument(format!(
                "range {i} of a kvs_copy_ranges table is {} bytes, more than the kernel's {} \
                 (cut it first: transfer::kernel_pieces)",
                r.bytes,
                abi::KVS_COPY_RANGE_MAX_BYTES
            )));
        }
        for space in spaces {
            check_space(
                self.backend.address_space(),
                space.address_space(),
                "range copy space",
            )?;
        }
        self.collect()?;
        let mut keep: Vec<Keep> = spaces.iter().map(|s| Keep::Space((*s).clone())).collect();
        let mut bytes = Vec::with_capacity(24 * ranges.len());
        for r in ranges {
            for word in [r.src, r.dst, r.bytes] {
                bytes.extend_from_slice(&word.to_le_bytes());
            }
        }
        let table = self.upload(&bytes, &mut keep)?;
        // The backend sets the status word at launch.
        let params = abi::kvs_copy_ranges_params {
            ranges: table,
            num_ranges: ranges.len() as u64,
            status: abi::kvs_status::default(),
        };
        let table = self.table.as_ref().map(Buffer::usage);
        let reads: Vec<&Usage> = table.into_iter().collect();
        let writes = [spaces[0].usage(), spaces[1].usage()];
        ordered(self.backend.as_ref(), &reads, &writes, || {
            // SAFETY: the caller checked every range against the two spaces, which are kept
            // alive until the stream has passed the launch (here and by their usages); the
            // table is this store's, stream-ordered.
            unsafe { self.backend.copy_ranges(params, launch) }
        })?;
        self.inflight.push_back((self.backend.record()?, keep));
        Ok(())
    }

    /// Bytes of device memory the store holds for tables.
    pub fn bytes(&self) -> usize {
        self.table.as_ref().map_or(0, Buffer::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::copy::Staging;
    use crate::geometry::{CacheGeometry, LatentLayout, PoolGeometry};

    #[test]
    fn the_range_table_builder_refuses_a_range_longer_than_the_kernel_takes() {
        let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new());
        let geometry = CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 1));
        let space = || -> Arc<dyn BlockSpace> {
            Arc::new(Staging::new(backend.as_ref(), &geometry, 1).unwrap())
        };
        let (src, dst) = (space(), space());
        let mut store = TableStore::new(backend.clone());
        let range = |bytes| abi::kvs_range {
            src: 0,
            dst: 0,
            bytes,
        };
        let launch = Launch {
            ctas: 1,
            threads: 32,
        };
        let ranges = [range(16), range(abi::KVS_COPY_RANGE_MAX_BYTES + 1)];
        match store.launch_ranges(&ranges, [&src, &dst], launch) {
            Err(Error::InvalidArgument(why)) => assert!(why.contains("range 1 "), "{why}"),
            other => panic!("a range over the kernel's bound was not refused: {other:?}"),
        }
        // Refused before anything was uploaded or launched.
        assert_eq!(store.bytes(), 0);
        backend.synchronize().unwrap();
    }
}
