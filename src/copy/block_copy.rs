//! Running block copies: a [`BlockCopyPlan`] uploaded to a backend ([`BlockCopy`], its tables
//! in kvshard's own [`TableBuffer`]) and launched whole, per layer, per window of entries or
//! signalled; and the [`TableStore`] of one-shot launches (a P/D chunk's copy, its tables in
//! the launch's parameters when they fit; a range table).
//! The plan itself, plain data checked against both spaces, is built in `copy::block_copy_plan`.
//!
//! A plan remembers the identity of the two spaces; [`BlockCopy::prepare_sync`] takes shared
//! ownership of exactly those spaces (anything else is refused), so the memory a launch
//! touches stays allocated while the copy can run.

use std::collections::VecDeque;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use super::ready_counters::{CounterWait, LayerSignals};
use super::space::BlockSpace;
use crate::abi;
use crate::backend::{
    check_space, ordered_event, ordered_pages, Backend, Buffer, Event, Launch, MemoryKind, Pages,
    Usage,
};
use crate::error::{Error, Result};
use crate::index::ModelLayer;

pub use super::block_copy_plan::{BlockCopyPlan, PageSelection};

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
    /// The pages a run of every entry touches on each side (what its usages order).
    touched: (Pages, Pages),
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
            touched: plan.touched(0..plan.entries),
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
            entries.clone(),
            signals.map_or(0, Buffer::addr),
        );
        // Only the pages these entries name: work of another stream on other pages of the same
        // pools (a load beside a backup) is not ordered after this launch.
        let window;
        let (src_pages, dst_pages) = if entries == (0..self.plan.entries) {
            (&self.touched.0, &self.touched.1)
        } else {
            window = self.plan.touched(entries);
            (&window.0, &window.1)
        };
        let all = Pages::All;
        let reads = [(self.src.usage(), src_pages), (tables.0.usage(), &all)];
        let mut writes = vec![(self.dst.usage(), dst_pages)];
        writes.extend(signals.map(|s| (s.usage(), &all)));
        ordered_pages(backend, &reads, &writes, || {
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

/// One-shot copies on one backend stream (a P/D chunk's block copy, a range table). A block
/// copy whose tables fit the launch's parameters carries them there (no upload, no table
/// memory); larger tables and range tables go to reusable device memory, each upload
/// stream-ordered after the launches that read the previous contents, so chunks need no
/// synchronization between them. The store keeps the spaces of every launch, and tables it
/// outgrew, until the stream has passed the launch (the launch's own event says when).
pub struct TableStore {
    backend: Arc<dyn Backend>,
    /// Whether a launch's event is timed ([`TableStore::set_timed`]).
    timed: bool,
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
            timed: true,
            table: None,
            inflight: VecDeque::new(),
        }
    }

    /// The backend it launches on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Whether the event each launch returns is timed (the default: a caller can read the
    /// launch's device time against an earlier timed event). Untimed events are lighter on
    /// the stream; the ordering and lifetimes they carry are the same.
    pub fn set_timed(&mut self, timed: bool) {
        self.timed = timed;
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
        self.upload_built(bytes.len(), |_| bytes.to_vec(), keep)
    }

    /// Uploads the `len` bytes `build` makes once it knows their device address (tables that
    /// point into themselves), stream-ordered, no wait; returns the address. A table it outgrew
    /// joins `keep`.
    fn upload_built(
        &mut self,
        len: usize,
        build: impl FnOnce(u64) -> Vec<u8>,
        keep: &mut Vec<Keep>,
    ) -> Result<u64> {
        let table = match self.table.take() {
            Some(t) if t.len() >= len => t,
            old => {
                keep.extend(old.map(Keep::Table));
                let want = len.max(64 << 10);
                self.backend.alloc(
                    want.checked_next_power_of_two().unwrap_or(want),
                    MemoryKind::Device,
                )?
            }
        };
        let addr = table.addr();
        let bytes = build(addr);
        let written = if bytes.len() == len {
            self.backend.enqueue_write(&table, 0, &bytes)
        } else {
            Err(Error::InvalidArgument(format!(
                "a table of {} bytes built for {len}",
                bytes.len()
            )))
        };
        self.table = Some(table);
        written.map(|()| addr)
    }

    /// Uploads the tables `build` makes (`len` bytes, built once their device address is
    /// known), then enqueues `run(address)` ordered after other streams' work on `reads` and
    /// `writes` (every one in the store's address space) and recorded on their usages; the
    /// spaces are kept until the stream has passed the launch. Returns the launch's event, as
    /// [`TableStore::launch`] does. For one-shot kernels other than the block copy whose tables
    /// the copy layer builds (`copy::decode_scatter`).
    pub(super) fn launch_built(
        &mut self,
        len: usize,
        build: impl FnOnce(u64) -> Vec<u8>,
        reads: &[&Arc<dyn BlockSpace>],
        writes: &[&Arc<dyn BlockSpace>],
        run: impl FnOnce(&dyn Backend, u64) -> Result<()>,
    ) -> Result<Event> {
        for space in reads.iter().chain(writes) {
            check_space(
                self.backend.address_space(),
                space.address_space(),
                "a copy space",
            )?;
        }
        self.collect()?;
        let mut keep: Vec<Keep> = reads
            .iter()
            .chain(writes)
            .map(|s| Keep::Space((*s).clone()))
            .collect();
        let tables = self.upload_built(len, build, &mut keep)?;
        let table = self.table.as_ref().map(Buffer::usage);
        let reads: Vec<&Usage> = reads.iter().map(|s| s.usage()).chain(table).collect();
        let writes: Vec<&Usage> = writes.iter().map(|s| s.usage()).collect();
        let backend = self.backend.as_ref();
        let ((), event) = ordered_event(backend, &reads, &writes, self.timed, || {
            run(backend, tables)
        })?;
        self.inflight.push_back((event.clone(), keep));
        Ok(event)
    }

    /// Launches `plan` once: with its tables in the launch's parameters when they fit
    /// (`kvs_copy_blocks_inline`: no upload, nothing in the stream before the launch), else
    /// uploaded into the store's memory first (`kvs_copy_blocks`). `src` and `dst` must be the
    /// plan's spaces, in the store's address space; they are kept until the launch has run.
    ///
    /// Returns the event (timed unless [`TableStore::set_timed`] said not) the stream reaches
    /// once the launch has run (`None` when the plan
    /// moves nothing): the one event recorded for the launch, which also orders other streams'
    /// work on the spaces and tells the store when to let them go.
    pub fn launch(
        &mut self,
        plan: &BlockCopyPlan,
        src: &Arc<dyn BlockSpace>,
        dst: &Arc<dyn BlockSpace>,
        launch: Launch,
    ) -> Result<Option<Event>> {
        plan.check_spaces(self.backend.as_ref(), src.as_ref(), dst.as_ref())?;
        if plan.pairs.is_empty() || plan.entries == 0 {
            return Ok(None);
        }
        plan.check_window(plan.entries)?;
        self.collect()?;
        let mut keep = vec![Keep::Space(src.clone()), Keep::Space(dst.clone())];
        let (backend, timed) = (self.backend.as_ref(), self.timed);
        let ((), event) = match plan.inline_params() {
            Some(params) => ordered_event(backend, &[src.usage()], &[dst.usage()], timed, || {
                // SAFETY: as in BlockCopy::launch: the spaces are the plan's, in the backend's
                // address space, and kept alive below (and by their usages) until the stream
                // has passed the launch; the tables travel in the parameters, which the
                // backend copies before returning.
                unsafe { backend.copy_blocks_inline(&params, launch) }
            })?,
            None => {
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
                let backend = self.backend.as_ref();
                ordered_event(backend, &reads, &[dst.usage()], timed, || {
                    // SAFETY: as above; the tables were just uploaded, in stream order, into
                    // this store's memory, which a later upload rewrites only after this launch
                    // in stream order (one backend, one stream).
                    unsafe { backend.copy_blocks(params, launch) }
                })?
            }
        };
        self.inflight.push_back((event.clone(), keep));
        Ok(Some(event))
    }

    /// Uploads `ranges` (already checked to lie inside `spaces`) and launches
    /// `kvs_copy_ranges` over them once; `spaces` are kept until the launch has run. Returns
    /// the launch's timed event, as [`TableStore::launch`] does (`None`: nothing launched). The only
    /// builder of `kvs_copy_ranges_params`: a range longer than the kernel takes
    /// ([`abi::KVS_COPY_RANGE_MAX_BYTES`]) is an [`Error::InvalidArgument`] before anything is
    /// uploaded or launched (callers cut ranges far shorter, `advanced::kernel_pieces`).
    pub(crate) fn launch_ranges(
        &mut self,
        ranges: &[abi::kvs_range],
        spaces: [&Arc<dyn BlockSpace>; 2],
        launch: Launch,
    ) -> Result<Option<Event>> {
        if ranges.is_empty() {
            return Ok(None);
        }
        if let Some((i, r)) = ranges
            .iter()
            .enumerate()
            .find(|(_, r)| r.bytes > abi::KVS_COPY_RANGE_MAX_BYTES)
        {
            return Err(Error::InvalidArgument(format!(
                "range {i} of a kvs_copy_ranges table is {} bytes, more than the kernel's {} \
                 (cut it first: advanced::kernel_pieces)",
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
        let ((), event) =
            ordered_event(self.backend.as_ref(), &reads, &writes, self.timed, || {
                // SAFETY: the caller checked every range against the two spaces, which are kept
                // alive until the stream has passed the launch (here and by their usages); the
                // table is this store's, stream-ordered.
                unsafe { self.backend.copy_ranges(params, launch) }
            })?;
        self.inflight.push_back((event.clone(), keep));
        Ok(Some(event))
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
    use crate::index::LocalPage;

    /// Pages `0..entries` of `src` to distinct, shuffled pages of `dst` (one layer, both
    /// components: two pairs, so the tables take 48 + 16 x entries bytes); the destination
    /// poisoned first, so bytes a launch must not touch are compared too.
    fn boundary_copy(
        backend: &Arc<dyn Backend>,
        entries: usize,
    ) -> (BlockCopyPlan, Arc<Staging>, Arc<Staging>) {
        let geometry = CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 1));
        let src = Staging::new(backend.as_ref(), &geometry, entries as u64).unwrap();
        let dst = Staging::new(backend.as_ref(), &geometry, entries as u64 + 3).unwrap();
        let bytes: Vec<u8> = (0..src.buffer().len())
            .map(|i| (i * 7 + i / 8191) as u8)
            .collect();
        backend.write_sync(src.buffer(), 0, &bytes).unwrap();
        backend.fill(dst.buffer(), 0xA5).unwrap();
        // Source page j lands on destination page (j * 37 + 2) mod (entries + 3), distinct.
        let src_pages: Vec<LocalPage> = (0..entries as u64).rev().map(LocalPage).collect();
        let dst_pages: Vec<LocalPage> = (0..entries as u64)
            .map(|j| LocalPage((j * 37 + 2) % (entries as u64 + 3)))
            .collect();
        let plan = BlockCopyPlan::new(
            &src,
            PageSelection::Local(src_pages),
            &dst,
            PageSelection::Local(dst_pages),
            entries,
        )
        .unwrap();
        (plan, Arc::new(src), Arc::new(dst))
    }

    #[test]
    fn tables_in_the_launch_move_the_bytes_of_uploaded_tables_up_to_where_they_stop_fitting() {
        let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new());
        let launch = Launch {
            ctas: 3,
            threads: 64,
        };
        let inline = abi::KVS_COPY_INLINE_BYTES as usize;
        // 48 + 16 x 509 = 8192 bytes fit exactly; one entry more does not.
        for (entries, fits) in [(1, true), (509, true), (510, false)] {
            let (plan, src, dst) = boundary_copy(&backend, entries);
            assert_eq!(plan.table_bytes() <= inline, fits, "{entries} entries");
            let mut store = TableStore::new(backend.clone());
            let (s, d): (Arc<dyn BlockSpace>, Arc<dyn BlockSpace>) = (src, dst.clone());
            let event = store.launch(&plan, &s, &d, launch).unwrap();
            assert!(event.is_some(), "a launch reports its event");
            // Only the fallback allocates table memory: an inline launch uploads nothing.
            assert_eq!(store.bytes() == 0, fits, "{entries} entries");
            let by_store = backend
                .read_sync(dst.buffer(), 0, dst.buffer().len())
                .unwrap();

            // The same plan through the prepared copy, whose tables are always uploaded.
            let (plan, src, dst) = boundary_copy(&backend, entries);
            let copy = BlockCopy::prepare(backend.as_ref(), plan, src, dst.clone(), None).unwrap();
            copy.run(backend.as_ref(), launch).unwrap();
            let uploaded = backend
                .read_sync(dst.buffer(), 0, dst.buffer().len())
                .unwrap();
            assert!(by_store == uploaded, "{entries} entries: the bytes differ");
            assert!(
                uploaded.contains(&0xA5),
                "the poison outside the copy stays"
            );
        }
        backend.synchronize().unwrap();
    }

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
