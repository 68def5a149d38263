//! Page copies between block spaces (gather, scatter, pool to pool, host I/O): a plain-data plan,
//! checked entirely on the host, then one `kvs_copy_blocks` launch for every component and layer.

use std::fmt;
use std::marker::PhantomData;

use super::{check_same_components, BlockSpace};
use crate::abi;
use crate::backend::{upload_i64s, Backend, Buffer, Launch};
use crate::error::{Error, Result};
use crate::shard::Placement;

/// Which page of one side entry `j` of a copy addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PageSelection {
    /// Entry `j` is page `j` (a staging buffer filled in entry order).
    Positions,
    /// Entry `j` is local page `ids[j]` of the space; negative ids skip the entry.
    Local(Vec<i64>),
    /// Entry `j` is logical page `ids[j]`: it moves only if `rank` owns it, to local page
    /// `ids[j] / N`. Negative ids skip the entry; reserved pages `0..N` are refused.
    Logical {
        /// Logical page ids.
        ids: Vec<i64>,
        /// Sharding of the ids.
        placement: Placement,
        /// The rank whose pages move.
        rank: u32,
    },
}

/// One side's page selection with the bound its pages must respect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageList {
    /// The selection.
    pub selection: PageSelection,
    /// Pages in the space (exclusive bound on the resulting local page).
    pub limit: u64,
}

impl PageList {
    fn new(
        selection: PageSelection,
        space: &dyn BlockSpace,
        entries: usize,
        side: &str,
    ) -> Result<Self> {
        let limit = space.pages();
        match &selection {
            PageSelection::Positions => {
                if entries as u64 > limit {
                    return Err(Error::OutOfRange {
                        what: "staging position",
                        index: entries as i64 - 1,
                        limit,
                    });
                }
            }
            PageSelection::Local(ids) => {
                check_len(ids, entries, side)?;
                if let Some(&bad) = ids.iter().find(|&&i| i >= 0 && i as u64 >= limit) {
                    return Err(Error::OutOfRange {
                        what: "local page",
                        index: bad,
                        limit,
                    });
                }
            }
            PageSelection::Logical {
                ids,
                placement,
                rank,
            } => {
                check_len(ids, entries, side)?;
                if *rank >= placement.shard() {
                    return Err(Error::InvalidArgument(format!(
                        "{side}: rank {rank} of shard size {}",
                        placement.shard()
                    )));
                }
                let logical = placement.logical_pages(limit);
                for &id in ids.iter().filter(|&&i| i >= 0) {
                    if id as u64 >= logical {
                        return Err(Error::OutOfRange {
                            what: "logical page",
                            index: id,
                            limit: logical,
                        });
                    }
                    if placement.is_reserved(id as u64) {
                        return Err(Error::ReservedPage {
                            page: id as u64,
                            shard: placement.shard(),
                        });
                    }
                }
            }
        }
        Ok(Self { selection, limit })
    }

    /// Whether entry `j` moves as far as this side is concerned.
    fn moves(&self, j: usize) -> bool {
        match &self.selection {
            PageSelection::Positions => true,
            PageSelection::Local(ids) => ids[j] >= 0,
            PageSelection::Logical {
                ids,
                placement,
                rank,
            } => ids[j] >= 0 && placement.owner(ids[j] as u64) == *rank,
        }
    }
}

fn check_len(ids: &[i64], entries: usize, side: &str) -> Result<()> {
    if ids.len() != entries {
        return Err(Error::InvalidArgument(format!(
            "{side}: {} page ids for {entries} entries",
            ids.len()
        )));
    }
    Ok(())
}

/// A block copy as plain data: what moves where, checked against both spaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockCopyPlan {
    /// Per component: rows and strides on each side (rows merged when both sides are
    /// contiguous, so the kernel's hot path has no division).
    pub components: Vec<abi::kvs_block_component>,
    /// Every (component, layer) moved, in component then layer order; `signal` is the model layer.
    pub pairs: Vec<abi::kvs_layer_pair>,
    /// Entries (pages) of the copy.
    pub entries: usize,
    /// Source pages.
    pub src: PageList,
    /// Destination pages.
    pub dst: PageList,
    /// Bytes of one entry across every pair.
    pub entry_bytes: u64,
}

impl BlockCopyPlan {
    /// Plans copying `entries` pages of every component and layer from `src` to `dst`.
    pub fn new(
        src: &dyn BlockSpace,
        src_pages: PageSelection,
        dst: &dyn BlockSpace,
        dst_pages: PageSelection,
        entries: usize,
    ) -> Result<Self> {
        check_same_components(src.components(), dst.components())?;
        let src_list = PageList::new(src_pages, src, entries, "source")?;
        let dst_list = PageList::new(dst_pages, dst, entries, "destination")?;
        let mut components = Vec::new();
        let mut pairs = Vec::new();
        for (c, layout) in src.components().iter().enumerate() {
            let (s, d) = (src.block_side(c), dst.block_side(c));
            let contiguous =
                s.row_stride == layout.row_bytes as u64 && d.row_stride == layout.row_bytes as u64;
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
            for (l, &model_layer) in layout.model_layers.iter().enumerate() {
                pairs.push(abi::kvs_layer_pair {
                    src: src.layer_base(c, l),
                    dst: dst.layer_base(c, l),
                    component: c as u32,
                    signal: model_layer as u32,
                });
            }
        }
        let mut plan = Self {
            components,
            pairs,
            entries,
            src: src_list,
            dst: dst_list,
            entry_bytes: 0,
        };
        plan.entry_bytes = plan.pair_bytes();
        Ok(plan)
    }

    fn pair_bytes(&self) -> u64 {
        self.pairs
            .iter()
            .map(|p| {
                let c = &self.components[p.component as usize];
                u64::from(c.rows) * u64::from(c.row_bytes)
            })
            .sum()
    }

    /// Keeps only the pairs of model layers `keep` accepts (per-layer loads).
    pub fn retain_layers(&mut self, keep: impl Fn(usize) -> bool) {
        self.pairs.retain(|p| keep(p.signal as usize));
        self.entry_bytes = self.pair_bytes();
    }

    /// Entries that actually move (not padding, owned on every logical side).
    pub fn moved_entries(&self) -> usize {
        (0..self.entries)
            .filter(|&j| self.src.moves(j) && self.dst.moves(j))
            .count()
    }

    /// Bytes the copy moves (each moved byte is read once and written once).
    pub fn bytes(&self) -> u64 {
        self.moved_entries() as u64 * self.entry_bytes
    }

    /// Units each ready signal counts once the copy is done: per model layer,
    /// `entries x pairs of that layer` (every unit counts, moved or skipped).
    pub fn signal_targets(&self, model_layers: usize) -> Vec<u32> {
        let mut t = vec![0u32; model_layers];
        for p in &self.pairs {
            t[p.signal as usize] += self.entries as u32;
        }
        t
    }
}

impl fmt::Display for BlockCopyPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} entries ({} move) x {} layer pairs, {} bytes",
            self.entries,
            self.moved_entries(),
            self.pairs.len(),
            self.bytes()
        )
    }
}

fn device_list<B: Backend>(
    backend: &B,
    list: &PageList,
    keep: &mut Vec<Buffer>,
) -> Result<abi::kvs_page_list> {
    let (kind, ids, shard, rank) = match &list.selection {
        PageSelection::Positions => (abi::KVS_INDEX_POSITION, None, 1, 0),
        PageSelection::Local(ids) => (abi::KVS_INDEX_LOCAL, Some(ids), 1, 0),
        PageSelection::Logical {
            ids,
            placement,
            rank,
        } => (abi::KVS_INDEX_LOGICAL, Some(ids), placement.shard(), *rank),
    };
    let ids = match ids {
        Some(ids) if !ids.is_empty() => {
            let buf = upload_i64s(backend, ids)?;
            let addr = buf.addr();
            keep.push(buf);
            addr
        }
        _ => 0,
    };
    Ok(abi::kvs_page_list {
        ids,
        limit: list.limit,
        kind,
        shard,
        rank,
        reserved: 0,
    })
}

/// A plan uploaded to one backend, ready to run (repeatedly). It borrows the spaces it copies
/// between, so they outlive it.
#[derive(Debug)]
pub struct BlockCopy<'a> {
    params: abi::kvs_copy_blocks_params,
    bytes: u64,
    /// Device copies of the pair table and page lists.
    _tables: Vec<Buffer>,
    _spaces: PhantomData<&'a ()>,
}

impl<'a> BlockCopy<'a> {
    /// Uploads `plan`'s tables to `backend`. `_src` and `_dst` are the spaces the plan was made
    /// for; borrowing them keeps them alive while the copy can run.
    pub fn prepare<B: Backend>(
        backend: &B,
        plan: &BlockCopyPlan,
        _src: &'a dyn BlockSpace,
        _dst: &'a dyn BlockSpace,
    ) -> Result<Self> {
        let mut tables = Vec::new();
        let mut pair_bytes = Vec::with_capacity(24 * plan.pairs.len());
        crate::backend::extend_pair_table(&mut pair_bytes, &plan.pairs);
        let pairs = backend.alloc(pair_bytes.len().max(24), crate::backend::MemoryKind::Device)?;
        backend.write(&pairs, 0, &pair_bytes)?;
        let mut components =
            [abi::kvs_block_component::default(); abi::KVS_MAX_COMPONENTS as usize];
        components[..plan.components.len()].copy_from_slice(&plan.components);
        let params = abi::kvs_copy_blocks_params {
            components,
            pairs: pairs.addr(),
            num_pages: plan.entries as u64,
            src_pages: device_list(backend, &plan.src, &mut tables)?,
            dst_pages: device_list(backend, &plan.dst, &mut tables)?,
            signals: 0,
            num_pairs: plan.pairs.len() as u32,
            num_components: plan.components.len() as u32,
            work: abi::kvs_work_queue::default(),
            status: abi::kvs_status::default(),
        };
        tables.push(pairs);
        Ok(Self {
            params,
            bytes: plan.bytes(),
            _tables: tables,
            _spaces: PhantomData,
        })
    }

    /// Bytes one run moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Enqueues the copy on `backend` with grid `launch`.
    pub fn run<B: Backend>(&self, backend: &B, launch: Launch) -> Result<()> {
        // SAFETY: every address comes from the spaces this copy borrows (alive for 'a) or from
        // tables it owns; every page index was checked against its space by the plan, and the
        // kernel re-checks them.
        unsafe { backend.copy_blocks(self.params, launch) }
    }

    /// Enqueues the copy, counting finished units into the u32 counters at `signals` (one per
    /// model layer; see [`BlockCopyPlan::signal_targets`]).
    ///
    /// # Safety
    /// `signals` must address one u32 per model layer of backend memory, alive until the copy ends.
    pub unsafe fn run_signalled<B: Backend>(
        &self,
        backend: &B,
        launch: Launch,
        signals: u64,
    ) -> Result<()> {
        let mut params = self.params;
        params.signals = signals;
        // SAFETY: as in run; the counters are the caller's contract.
        unsafe { backend.copy_blocks(params, launch) }
    }
}
