//! The owned-row write path (DOMAIN.md section 4): a prefill chunk is staged whole in scratch,
//! then only the rows this rank owns are persisted to its local rows, for every selected layer
//! of target and draft, latent and indexer, in one `kvs_write_rows` launch that does the owner
//! filtering itself.

use std::marker::PhantomData;

use super::DevicePool;
use crate::abi;
use crate::backend::{upload_i64s, Backend, Buffer, Launch, MemoryKind};
use crate::error::{Error, Result};
use crate::geometry::{ComponentLayout, INDEXER_PAGE_BYTES, INDEXER_ROW_BYTES, PAGE_SIZE};

/// Chunk staging (the "current chunk" part of scratch): per component and layer, latent rows
/// `[tokens][row_bytes]` or page-major indexer blocks `[tokens / 64][8448]`, row `i` holding
/// chunk token `i`.
#[derive(Debug)]
pub struct ChunkStaging {
    components: Vec<ComponentLayout>,
    tokens: usize,
    /// Per component: (offset, layer stride).
    regions: Vec<(usize, usize)>,
    buffer: Buffer,
}

fn layer_bytes(c: &ComponentLayout, tokens: usize) -> usize {
    if c.component.is_indexer() {
        tokens.div_ceil(PAGE_SIZE) * INDEXER_PAGE_BYTES
    } else {
        tokens * c.row_bytes
    }
}

impl ChunkStaging {
    /// Staging for chunks of up to `tokens` tokens, shaped like `pool`.
    pub fn new<B: Backend>(backend: &B, pool: &DevicePool, tokens: usize) -> Result<Self> {
        let components = pool.components.clone();
        let mut regions = Vec::new();
        let mut total = 0;
        for c in &components {
            let stride = layer_bytes(c, tokens).next_multiple_of(256);
            regions.push((total, stride));
            total += stride * c.layers();
        }
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

    /// The staging of stored layer `layer` of component index `c`.
    pub fn layer(&self, c: usize, layer: usize) -> Result<Buffer> {
        let comp = self.components.get(c).ok_or(Error::OutOfRange {
            what: "component",
            index: c as i64,
            limit: self.components.len() as u64,
        })?;
        if layer >= comp.layers() {
            return Err(Error::OutOfRange {
                what: "layer",
                index: layer as i64,
                limit: comp.layers() as u64,
            });
        }
        let (offset, stride) = self.regions[c];
        self.buffer
            .slice(offset + layer * stride, layer_bytes(comp, self.tokens))
    }
}

/// A prepared owned-row write from a [`ChunkStaging`] into a [`DevicePool`].
#[derive(Debug)]
pub struct OwnedRowWrite<'a> {
    params: abi::kvs_write_rows_params,
    row_bytes: u64,
    capacity: usize,
    _pairs: Buffer,
    _spaces: PhantomData<&'a ()>,
}

impl<'a> OwnedRowWrite<'a> {
    /// Prepares writes of the model layers `keep` accepts (e.g. one layer during its forward).
    pub fn prepare<B: Backend>(
        backend: &B,
        staging: &'a ChunkStaging,
        pool: &'a DevicePool,
        keep: impl Fn(usize) -> bool,
    ) -> Result<Self> {
        super::check_same_components(&staging.components, &pool.components)?;
        let mut components = [abi::kvs_row_component::default(); abi::KVS_MAX_COMPONENTS as usize];
        let mut pairs = Vec::new();
        let mut row_bytes = 0u64;
        for (c, layout) in pool.components.iter().enumerate() {
            let (kind, bytes) = if layout.component.is_indexer() {
                (abi::KVS_ROWS_INDEXER, INDEXER_ROW_BYTES)
            } else {
                (abi::KVS_ROWS_LATENT, layout.row_bytes)
            };
            components[c] = abi::kvs_row_component {
                kind,
                row_bytes: bytes as u32,
            };
            for (l, &model_layer) in layout.model_layers.iter().enumerate() {
                if keep(model_layer) {
                    pairs.push(abi::kvs_layer_pair {
                        src: staging.layer(c, l)?.addr(),
                        dst: pool.layer_bases(c)[l],
                        component: c as u32,
                        signal: model_layer as u32,
                    });
                    row_bytes += bytes as u64;
                }
            }
        }
        let num_pairs = pairs.len() as u32;
        let mut table_bytes = Vec::with_capacity(24 * pairs.len());
        crate::backend::extend_pair_table(&mut table_bytes, &pairs);
        let table = backend.alloc(table_bytes.len().max(24), MemoryKind::Device)?;
        backend.write(&table, 0, &table_bytes)?;
        let placement = pool.placement();
        let params = abi::kvs_write_rows_params {
            components,
            pairs: table.addr(),
            slots: 0,
            num_slots: 0,
            slot_limit: pool.logical_capacity(),
            dst_rows: pool.pages * PAGE_SIZE as u64,
            num_pairs,
            shard: placement.shard(),
            rank: pool.rank(),
            num_components: pool.components.len() as u32,
            work: abi::kvs_work_queue::default(),
            status: abi::kvs_status::default(),
        };
        Ok(Self {
            params,
            row_bytes,
            capacity: staging.tokens,
            _pairs: table,
            _spaces: PhantomData,
        })
    }

    /// The grid for a chunk of `n` tokens: one warp per unit (a group of 8 tokens x a block of
    /// 4 layer pairs; see cuda/copy.cu), so that the hardware's CTA scheduler balances the load
    /// between units this rank owns and units it skips after one slot read.
    pub fn launch(&self, n: usize) -> Launch {
        const WARPS: u64 = 512 / 32;
        let units = crate::backend::write_units(n as u64, self.params.num_pairs);
        Launch {
            ctas: units.div_ceil(WARPS).clamp(1, u64::from(u32::MAX)) as u32,
            threads: 512,
        }
    }

    /// Bytes one owned token moves (read once, written once) across the selected layers.
    pub fn row_bytes(&self) -> u64 {
        self.row_bytes
    }

    /// Persists the owned rows of a chunk whose logical slots are the `n` int64s of `slots`
    /// (device memory, as engines keep them). Slots are checked by the kernel: a bad one is
    /// skipped and reported by the backend's next `synchronize`.
    pub fn run<B: Backend>(
        &self,
        backend: &B,
        slots: &Buffer,
        n: usize,
        launch: Launch,
    ) -> Result<()> {
        if n > self.capacity || slots.len() < 8 * n {
            return Err(Error::InvalidArgument(format!(
                "{n} slots (buffer of {} bytes) for a staging of {} tokens",
                slots.len(),
                self.capacity
            )));
        }
        let mut params = self.params;
        params.slots = slots.addr();
        params.num_slots = n as u64;
        // SAFETY: staging and pool addresses come from the borrowed spaces; the slot buffer holds
        // `n` entries; the kernel bounds-checks every slot and local row before writing.
        unsafe { backend.write_rows(params, launch) }
    }

    /// Checks `slots` on the host (every slot negative or inside the logical capacity), uploads
    /// them and runs the write; a bad slot is an error before anything is written.
    pub fn run_checked<B: Backend>(
        &self,
        backend: &B,
        slots: &[i64],
        launch: Launch,
    ) -> Result<()> {
        if let Some(&bad) = slots
            .iter()
            .find(|&&s| s >= 0 && s as u64 >= self.params.slot_limit)
        {
            return Err(Error::OutOfRange {
                what: "logical slot",
                index: bad,
                limit: self.params.slot_limit,
            });
        }
        let buf = upload_i64s(backend, slots)?;
        self.run(backend, &buf, slots.len(), launch)?;
        backend.synchronize()
    }
}
