//! The owned-row write path (docs/design.md, "Prefill"): a prefill chunk is staged whole in
//! scratch, then only the rows this rank owns are persisted to its local rows, for every
//! selected layer of target and draft, latent and indexer, in one `kvs_write_rows` launch that
//! does the owner filtering itself.

use std::collections::HashMap;
use std::sync::Arc;

use super::DevicePool;
use crate::abi;
use crate::backend::{
    ordered, upload_reused_sync, Backend, Buffer, KernelFamily, Launch, MemoryKind,
};
use crate::copy::space::layer_regions;
use crate::copy::space::sealed::Sealed as _;
use crate::copy::BlockSpace;
use crate::error::{Checked, Error, Result};
use crate::geometry::{
    Component, ComponentLayout, INDEXER_PAGE_BYTES, INDEXER_ROW_BYTES, PAGE_SIZE,
};
use crate::index::{ModelLayer, Slot, StoredLayer};

/// Chunk staging (the "current chunk" part of scratch): per component and stored layer, latent
/// rows `[tokens][row_bytes]` or page-major indexer blocks `[tokens / 64][8448]`, row `i`
/// holding chunk token `i`. What the quantizers write and the owned-row write reads.
#[derive(Debug)]
pub struct ChunkStaging {
    components: Vec<ComponentLayout>,
    tokens: usize,
    /// Per component: (offset, layer stride).
    regions: Vec<(usize, usize)>,
    buffer: Buffer,
}

fn layer_bytes(c: &ComponentLayout, tokens: usize) -> Result<usize> {
    let what = || format!("staging of {tokens} tokens of {}", c.component);
    if c.component.is_indexer() {
        tokens.div_ceil(PAGE_SIZE).mul_or(INDEXER_PAGE_BYTES, what)
    } else {
        tokens.mul_or(c.row_bytes, what)
    }
}

impl ChunkStaging {
    /// Staging for chunks of up to `tokens` tokens, shaped like `pool`, in `backend`'s device
    /// memory.
    pub fn new(backend: &dyn Backend, pool: &DevicePool, tokens: usize) -> Result<Self> {
        let components = pool.components().to_vec();
        let (regions, total) = layer_regions(
            &components,
            |c| format!("staging of {tokens} tokens of {}", c.component),
            |c| layer_bytes(c, tokens),
        )?;
        let buffer = backend.alloc(total, MemoryKind::Device)?;
        Ok(Self {
            components,
            tokens,
            regions,
            buffer,
        })
    }

    /// Capacity in tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The whole buffer.
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }

    /// The staging of stored layer `layer` of `component`.
    pub fn layer(&self, component: Component, layer: StoredLayer) -> Result<Buffer> {
        let c = self
            .components
            .iter()
            .position(|l| l.component == component)
            .ok_or_else(|| Error::InvalidArgument(format!("the staging holds no {component}")))?;
        let comp = &self.components[c];
        comp.check_layer(layer)?;
        let (offset, stride) = self.regions[c];
        // In range: `new` laid out `layers` strides of at least layer_bytes each.
        self.buffer
            .slice(offset + layer.0 * stride, layer_bytes(comp, self.tokens)?)
    }
}

/// A prepared owned-row write from a [`ChunkStaging`] into a [`DevicePool`]; it holds both.
#[derive(Debug)]
pub struct OwnedRowWrite {
    params: abi::kvs_write_rows_params,
    row_bytes: u64,
    pool: Arc<DevicePool>,
    staging: Arc<ChunkStaging>,
    _pairs: Buffer,
}

impl OwnedRowWrite {
    /// Prepares writes of the model layers `keep` accepts (all of them, or one layer during its
    /// forward), uploading the pair table through `backend` (waits for the upload).
    pub fn prepare_sync(
        backend: &dyn Backend,
        staging: Arc<ChunkStaging>,
        pool: Arc<DevicePool>,
        keep: impl Fn(ModelLayer) -> bool,
    ) -> Result<Self> {
        Self::prepare_components_sync(backend, staging, pool, |_, m| keep(m))
    }

    /// [`Self::prepare_sync`] for the (component, model layer) pairs `keep` accepts: an engine
    /// whose indexer keys are written by its own kernel persists only the latent rows here.
    pub fn prepare_components_sync(
        backend: &dyn Backend,
        staging: Arc<ChunkStaging>,
        pool: Arc<DevicePool>,
        keep: impl Fn(Component, ModelLayer) -> bool,
    ) -> Result<Self> {
        crate::copy::space::check_same_components(&staging.components, pool.components())?;
        backend.check(&staging.buffer, "chunk staging")?;
        crate::backend::check_space(backend.address_space(), pool.address_space(), "the pool")?;
        let mut components = [abi::kvs_row_component::default(); abi::KVS_MAX_COMPONENTS as usize];
        let mut table = Vec::new();
        let mut num_pairs = 0u32;
        let mut row_bytes = 0u64;
        for (c, layout) in pool.components().iter().enumerate() {
            let (kind, bytes) = if layout.component.is_indexer() {
                (abi::KVS_ROWS_INDEXER, INDEXER_ROW_BYTES)
            } else {
                (abi::KVS_ROWS_LATENT, layout.row_bytes)
            };
            components[c] = abi::kvs_row_component {
                kind,
                row_bytes: bytes as u32,
            };
            let bases = pool.layer_bases(layout.component)?;
            for (l, &model_layer) in layout.model_layers.iter().enumerate() {
                if !keep(layout.component, model_layer) {
                    continue;
                }
                let src = staging.layer(layout.component, StoredLayer(l))?.addr();
                for word in [src, bases[l]] {
                    table.extend_from_slice(&word.to_le_bytes());
                }
                table.extend_from_slice(&(c as u32).to_le_bytes());
                table.extend_from_slice(&(model_layer.0 as u32).to_le_bytes());
                num_pairs += 1;
                row_bytes += bytes as u64;
            }
        }
        let pairs = backend.alloc(table.len().max(24), MemoryKind::Device)?;
        backend.write_sync(&pairs, 0, &table)?;
        let placement = pool.placement();
        let params = abi::kvs_write_rows_params {
            components,
            pairs: pairs.addr(),
            slots: 0,
            num_slots: 0,
            slot_limit: pool.logical_capacity(),
            dst_rows: pool.pages() * PAGE_SIZE as u64,
            num_pairs,
            shard: placement.shard(),
            rank: pool.rank(),
            num_components: pool.components().len() as u32,
            work: abi::kvs_work_queue::default(),
            status: abi::kvs_status::default(),
        };
        Ok(Self {
            params,
            row_bytes,
            pool,
            staging,
            _pairs: pairs,
        })
    }

    /// The pool written.
    pub fn pool(&self) -> &Arc<DevicePool> {
        &self.pool
    }

    /// The staging read.
    pub fn staging(&self) -> &Arc<ChunkStaging> {
        &self.staging
    }

    /// The grid kvshard picks for a chunk of `n` tokens on `backend`: one warp per unit (a group
    /// of 8 tokens x a block of 4 layer pairs; see cuda/copy.cu), so that the hardware's CTA
    /// scheduler balances the load between units this rank owns and units it skips after one
    /// slot read.
    pub fn launch(&self, backend: &dyn Backend, n: usize) -> Launch {
        let threads = backend.max_threads(KernelFamily::WriteRows);
        let warps = u64::from(threads / 32).max(1);
        let units = crate::backend::write_units(n as u64, self.params.num_pairs);
        Launch {
            ctas: units.div_ceil(warps).clamp(1, u64::from(u32::MAX)) as u32,
            threads,
        }
    }

    /// Bytes one owned token moves (read once, written once) across the selected layers.
    pub fn row_bytes(&self) -> u64 {
        self.row_bytes
    }

    /// Persists the owned rows of a chunk whose logical slots are the first `n` int64s of the
    /// engine's device buffer `slots`, on `backend`'s stream: no allocation, no wait. Slots are
    /// checked by the kernel: a bad one (beyond the logical capacity, or on a reserved padding
    /// page) is skipped and reported by the backend's next `synchronize`.
    pub fn run(
        &self,
        backend: &dyn Backend,
        slots: &Buffer,
        n: usize,
        launch: Launch,
    ) -> Result<()> {
        backend.check(slots, "slot buffer")?;
        crate::backend::check_space(
            backend.address_space(),
            self.pool.address_space(),
            "the pool",
        )?;
        let bytes = n.mul_or(8, || format!("bytes of {n} slots"))?;
        if n > self.staging.tokens || slots.len() < bytes || slots.addr() % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "{n} slots (an 8-byte aligned buffer of {} bytes) for a staging of {} tokens",
                slots.len(),
                self.staging.tokens
            )));
        }
        let mut params = self.params;
        params.slots = slots.addr();
        params.num_slots = n as u64;
        let reads = [
            self.staging.buffer.usage(),
            slots.usage(),
            self._pairs.usage(),
        ];
        ordered(backend, &reads, &[self.pool.usage()], || {
            // SAFETY: staging and pool addresses come from the two spaces this write holds,
            // both checked to be in the backend's address space, whose usages (and the slot
            // buffer's and the pair table's) keep the memory until the launch has run; the
            // slot buffer holds `n` aligned int64s of that space; the kernel bounds-checks
            // every slot and local row (against the pool's capacity) before writing, and reads
            // staging rows below `n`, which is at most the staging's capacity.
            unsafe { backend.write_rows(params, launch) }
        })
    }

    /// Checks `slots` on the host (every slot inside the logical capacity, on no reserved
    /// padding page, and no two the same), uploads them and runs the write, then waits for it:
    /// a bad slot is an error before anything is written.
    pub fn run_checked_sync(
        &self,
        backend: &dyn Backend,
        slots: &[Slot],
        launch: Launch,
    ) -> Result<()> {
        let placement = self.pool.placement();
        let mut seen = HashMap::with_capacity(slots.len());
        for (i, &slot) in slots.iter().enumerate() {
            if slot.0 >= self.params.slot_limit {
                return Err(Error::OutOfRange {
                    what: "logical slot",
                    index: i64::try_from(slot.0).unwrap_or(i64::MAX),
                    limit: self.params.slot_limit,
                });
            }
            if placement.is_reserved(slot.page()) {
                return Err(Error::ReservedPage {
                    page: slot.page().0,
                    shard: placement.shard(),
                });
            }
            if let Some(first) = seen.insert(slot, i) {
                return Err(Error::DuplicatePage {
                    what: "logical slot",
                    page: slot.0,
                    first,
                    second: i,
                });
            }
        }
        let raw: Vec<i64> = slots.iter().map(|s| s.0 as i64).collect();
        let buf = upload_reused_sync(backend, &raw)?;
        self.run(backend, buf.buffer(), slots.len(), launch)?;
        backend.synchronize()
    }
}
