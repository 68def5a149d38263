//! [`HostPool`]: one rank's host pool (the module docs of [`super`] give its buffers, layouts
//! and memory), a [`BlockSpace`] the copy layer moves its pages through.

use crate::abi;
use crate::backend::{AddressSpace, Backend, Buffer, Usage};
use crate::copy::space::sealed;
use crate::copy::{BlockSpace, SpaceId};
use crate::error::{Error, Result};
use crate::geometry::{CacheGeometry, Component, ComponentLayout};
use crate::index::{LocalPage, StoredLayer};

use super::{HostBufferLayout, HostFormat, HostLayout, LayoutStrides, NumaPlacement};

/// One buffer of a pool: its layout, its memory and, where known, its host address.
#[derive(Debug)]
pub(super) struct HostBuf {
    pub(super) layout: HostBufferLayout,
    pub(super) memory: Buffer,
    pub(super) host: Option<usize>,
}

/// One rank's pinned host pool: `pages` pages of every component in one [`HostFormat`].
/// Engines share it as `Arc<HostPool>` with the HiCache controller.
#[derive(Debug)]
pub struct HostPool {
    pub(super) id: SpaceId,
    pub(super) space: AddressSpace,
    pub(super) geometry: CacheGeometry,
    pub(super) format: HostFormat,
    pub(super) pages: u64,
    pub(super) components: Vec<ComponentLayout>,
    /// Per component: (buffer, first stored layer in the buffer).
    pub(super) slots: Vec<(usize, usize)>,
    pub(super) buffers: Vec<HostBuf>,
    pub(super) numa: NumaPlacement,
    pub(super) usage: Usage,
}

impl HostPool {
    /// Cache geometry.
    pub fn geometry(&self) -> &CacheGeometry {
        &self.geometry
    }

    /// Layout of every buffer.
    pub fn layout(&self) -> HostLayout {
        self.format.layout
    }

    /// The pool's format.
    pub fn format(&self) -> HostFormat {
        self.format
    }

    /// Strides of `component` (its buffer's).
    pub fn strides(&self, component: Component) -> Result<LayoutStrides> {
        let (b, _) = self.slots[self.component_index(component)?];
        Ok(self.buffers[b].layout.strides)
    }

    /// The memory of the buffer holding `component` (with a packed draft, a draft component's
    /// is the target's).
    pub fn buffer(&self, component: Component) -> Result<&Buffer> {
        let (b, _) = self.slots[self.component_index(component)?];
        Ok(&self.buffers[b].memory)
    }

    /// The buffer holding `component`, and the buffer layer of its stored layer 0.
    pub fn component_buffer(&self, component: Component) -> Result<(usize, usize)> {
        Ok(self.slots[self.component_index(component)?])
    }

    /// The layout of every buffer, in order.
    pub fn buffer_layouts(&self) -> Vec<&HostBufferLayout> {
        self.buffers.iter().map(|b| &b.layout).collect()
    }

    /// The layout of buffer `index`.
    pub fn buffer_layout(&self, index: usize) -> Result<&HostBufferLayout> {
        Ok(&self.buf(index)?.layout)
    }

    /// The memory of buffer `index` (its device alias on CUDA).
    pub fn buffer_memory(&self, index: usize) -> Result<&Buffer> {
        Ok(&self.buf(index)?.memory)
    }

    /// The host address of buffer `index`, where known: memory kvshard allocated pinned on
    /// CUDA (the driver says), registered or adopted memory, and wrapped memory whose caller
    /// said. `None` for the CPU backend's own allocations (`CpuBackend::host_ptr` gives theirs).
    pub fn host_ptr(&self, index: usize) -> Result<Option<*mut u8>> {
        Ok(self.buf(index)?.host.map(|h| h as *mut u8))
    }

    fn buf(&self, index: usize) -> Result<&HostBuf> {
        self.buffers.get(index).ok_or(Error::OutOfRange {
            what: "host buffer",
            index: index as i64,
            limit: self.buffers.len() as u64,
        })
    }

    /// Bytes of the whole pool.
    pub fn bytes(&self) -> usize {
        self.buffers.iter().map(|b| b.memory.len()).sum()
    }

    /// Where the pool's pages were placed.
    pub fn numa(&self) -> &NumaPlacement {
        &self.numa
    }

    /// Keeps `owner` alive until the pool and all work queued on it are gone
    /// ([`Usage::keep_alive`]): what holds the engine memory a wrapped or adopted pool lends.
    /// (Memory kvshard registers must also outlive its unregistration:
    /// [`HostPool::register_with_owner`].)
    pub fn keep_alive(&self, owner: Box<dyn Send + Sync>) {
        self.usage.keep_alive(owner);
    }

    /// Byte offset of row `row` of block (`layer`, `page`) of `component` from the start of
    /// its buffer.
    pub fn row_offset(
        &self,
        component: Component,
        layer: StoredLayer,
        page: LocalPage,
        row: usize,
    ) -> Result<u64> {
        let c = self.component_index(component)?;
        let comp = &self.components[c];
        for (what, index, limit) in [
            ("layer", layer.0 as u64, comp.layers() as u64),
            ("host page", page.0, self.pages),
            ("row", row as u64, comp.rows as u64),
        ] {
            if index >= limit {
                return Err(Error::OutOfRange {
                    what,
                    index: i64::try_from(index).unwrap_or(i64::MAX),
                    limit,
                });
            }
        }
        let (b, first) = self.slots[c];
        // In range: checked against the component above, and its layers sit inside the buffer.
        self.buffers[b]
            .layout
            .offset(first + layer.0, page.0, row)
            .ok_or_else(|| Error::HiCache(format!("{component} row outside its buffer")))
    }

    /// Address (device alias) of row `row` of block (`layer`, `page`) of `component`.
    pub fn row_addr(
        &self,
        component: Component,
        layer: StoredLayer,
        page: LocalPage,
        row: usize,
    ) -> Result<u64> {
        let offset = self.row_offset(component, layer, page, row)?;
        let (b, _) = self.slots[self.component_index(component)?];
        Ok(self.buffers[b].memory.addr() + offset)
    }

    /// The byte ranges `(offset from the buffer's start, bytes)` holding local page `page` of
    /// buffer `index`, every layer of it (a packed draft's too), in layer order: one range in
    /// the page-major layouts, one per layer in `layer_first`. What a storage backend reads or
    /// writes for one page (SGLang's `get_page_buffer_meta`).
    pub fn page_spans(&self, index: usize, page: LocalPage) -> Result<Vec<(u64, u64)>> {
        let layout = &self.buf(index)?.layout;
        if page.0 >= layout.pages {
            return Err(Error::OutOfRange {
                what: "host page",
                index: i64::try_from(page.0).unwrap_or(i64::MAX),
                limit: layout.pages,
            });
        }
        let s = layout.strides;
        let block = layout.block_bytes as u64;
        Ok(match self.format.layout {
            HostLayout::LayerFirst => (0..layout.layers as u64)
                .map(|l| (l * s.layer_stride + page.0 * s.page_stride, block))
                .collect(),
            HostLayout::PageFirst | HostLayout::PageFirstDirect => {
                vec![(page.0 * s.page_stride, layout.layers as u64 * block)]
            }
        })
    }

    /// Every block of the pool in canonical order (component, layer, page, rows in order), the
    /// same bytes whatever the format: what byte-identity tests compare.
    pub fn snapshot_sync(&self, backend: &dyn Backend) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(self.bytes());
        let raw = self
            .buffers
            .iter()
            .map(|b| backend.read_sync(&b.memory, 0, b.memory.len()))
            .collect::<Result<Vec<_>>>()?;
        for (c, comp) in self.components.iter().enumerate() {
            let (b, first) = self.slots[c];
            let layout = &self.buffers[b].layout;
            for l in 0..comp.layers() {
                for p in 0..self.pages {
                    for r in 0..comp.rows {
                        let at = layout
                            .offset(first + l, p, r)
                            .ok_or_else(|| Error::HiCache("snapshot outside a buffer".into()))?
                            as usize;
                        out.extend_from_slice(&raw[b][at..at + comp.row_bytes]);
                    }
                }
            }
        }
        Ok(out)
    }

    /// Sets every byte of the pool to `byte` (stream-ordered on `backend`).
    pub fn fill(&self, backend: &dyn Backend, byte: u8) -> Result<()> {
        self.buffers
            .iter()
            .try_for_each(|b| backend.fill(&b.memory, byte))
    }
}

impl sealed::Sealed for HostPool {
    fn base(&self, c: usize, layer: usize) -> u64 {
        let (b, first) = self.slots[c];
        let buf = &self.buffers[b];
        buf.memory.addr() + (first + layer) as u64 * buf.layout.strides.layer_stride
    }

    fn side(&self, c: usize) -> abi::kvs_block_side {
        let s = self.buffers[self.slots[c].0].layout.strides;
        abi::kvs_block_side {
            page_stride: s.page_stride,
            row_stride: s.row_stride,
        }
    }

    fn layer_count(&self, c: usize) -> usize {
        self.components[c].layers()
    }

    fn usage(&self) -> &Usage {
        &self.usage
    }
}

crate::copy::space::block_space!(HostPool);
#[cfg(test)]
mod tests {
    //! Offsets checked against SGLang's own tensor shapes (sglang 0.5.x `pool_host/mla.py` and
    //! `dsa.py`): the byte offset of an element is the dot product of its index with the
    //! tensor's C-contiguous strides, computed here from the shapes alone.
    use super::*;
    use std::sync::Arc;

    use crate::backend::cpu::CpuBackend;
    use crate::backend::MemoryKind;
    use crate::geometry::{LatentLayout, PoolGeometry, INDEXER_PAGE_BYTES, PAGE_SIZE};
    use crate::index::ModelLayer;
    use crate::pool::host::HostMemory;

    /// C-contiguous byte strides of `shape` (elements of `item` bytes).
    fn contiguous(shape: &[u64], item: u64) -> Vec<u64> {
        let mut strides = vec![item; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        strides
    }

    fn at(shape: &[u64], index: &[u64], item: u64) -> u64 {
        assert_eq!(shape.len(), index.len());
        assert!(
            index.iter().zip(shape).all(|(i, s)| i < s),
            "{index:?} in {shape:?}"
        );
        contiguous(shape, item)
            .iter()
            .zip(index)
            .map(|(s, i)| s * i)
            .sum()
    }

    /// SGLang's MLA host `kv_buffer` shape for `layers` layers (target + packed draft) of rows
    /// of `row` bytes (uint8) and `page_num` pages, and the index of row `r` of (`l`, `p`).
    fn sglang_mla(layout: HostLayout, layers: u64, page_num: u64, row: u64) -> Vec<u64> {
        let size = page_num * PAGE_SIZE as u64;
        match layout {
            HostLayout::LayerFirst => vec![layers, size, 1, row],
            HostLayout::PageFirst => vec![size, layers, 1, row],
            HostLayout::PageFirstDirect => vec![page_num, layers, PAGE_SIZE as u64, 1, row],
        }
    }

    fn sglang_mla_index(layout: HostLayout, l: u64, p: u64, r: u64) -> Vec<u64> {
        let token = p * PAGE_SIZE as u64 + r;
        match layout {
            HostLayout::LayerFirst => vec![l, token, 0, 0],
            HostLayout::PageFirst => vec![token, l, 0, 0],
            HostLayout::PageFirstDirect => vec![p, l, r, 0, 0],
        }
    }

    /// SGLang's DSA indexer host buffer shape: `indexer_page_num = (size + 64 + 1) // 64`.
    fn sglang_indexer(layout: HostLayout, layers: u64, page_num: u64) -> (Vec<u64>, u64) {
        let size = page_num * PAGE_SIZE as u64;
        let pages = (size + PAGE_SIZE as u64 + 1) / PAGE_SIZE as u64;
        let b = INDEXER_PAGE_BYTES as u64;
        let shape = match layout {
            HostLayout::LayerFirst => vec![layers, pages, b],
            _ => vec![pages, layers, 1, b],
        };
        (shape, pages)
    }

    fn sglang_indexer_index(layout: HostLayout, l: u64, p: u64) -> Vec<u64> {
        match layout {
            HostLayout::LayerFirst => vec![l, p, 0],
            _ => vec![p, l, 0, 0],
        }
    }

    fn geometries() -> Vec<CacheGeometry> {
        let shared = vec![true, false, true, true];
        vec![
            CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
                LatentLayout::Fp8Scaled,
                shared.clone(),
            )),
            CacheGeometry::target_only(PoolGeometry::with_indexer_layers(
                LatentLayout::Fp8Trtllm,
                shared,
            )),
            CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Bf16, 3)),
        ]
    }

    #[test]
    fn every_row_sits_where_sglangs_shapes_put_it() {
        let pages = 5u64;
        let b = CpuBackend::new();
        for g in geometries() {
            let row = g.target.row_bytes() as u64;
            let target = g.target.num_layers() as u64;
            let target_ix = g.target.num_indexer_layers() as u64;
            for layout in HostLayout::ALL {
                for packed in [false, true] {
                    let format = HostFormat::sglang(layout, packed);
                    let host = HostPool::new_with(&b, &g, pages, format).unwrap();
                    let draft = g.draft.is_some() && packed;
                    let latent_layers = target + u64::from(draft);
                    let ix_layers = target_ix + u64::from(draft);
                    let latent_shape = sglang_mla(layout, latent_layers, pages, row);
                    let (ix_shape, ix_pages) = sglang_indexer(layout, ix_layers, pages);
                    assert_eq!(ix_pages, pages + 1);
                    for comp in host.components().to_vec() {
                        let (buf, first) = host.component_buffer(comp.component).unwrap();
                        let layout_b = host.buffer_layout(buf).unwrap().clone();
                        let expected_bytes: u64 = if comp.component.is_indexer() {
                            if draft || comp.component == Component::TargetIndexer {
                                ix_shape.iter().product()
                            } else {
                                sglang_indexer(layout, 1, pages).0.iter().product()
                            }
                        } else if draft || comp.component == Component::TargetLatent {
                            latent_shape.iter().product::<u64>()
                        } else {
                            sglang_mla(layout, 1, pages, row).iter().product()
                        };
                        let item = 1u64;
                        assert_eq!(
                            layout_b.bytes as u64,
                            expected_bytes * item,
                            "{layout} {format}"
                        );
                        for l in 0..comp.layers() {
                            for p in [1u64, 3, pages - 1] {
                                for r in (0..comp.rows).step_by(7) {
                                    let got = host
                                        .row_offset(comp.component, StoredLayer(l), LocalPage(p), r)
                                        .unwrap();
                                    let hl = (first + l) as u64;
                                    let want = if comp.component.is_indexer() {
                                        let shape = if draft
                                            || comp.component == Component::TargetIndexer
                                        {
                                            ix_shape.clone()
                                        } else {
                                            sglang_indexer(layout, 1, pages).0
                                        };
                                        at(&shape, &sglang_indexer_index(layout, hl, p), 1)
                                    } else {
                                        let shape =
                                            if draft || comp.component == Component::TargetLatent {
                                                latent_shape.clone()
                                            } else {
                                                sglang_mla(layout, 1, pages, row)
                                            };
                                        at(&shape, &sglang_mla_index(layout, hl, p, r as u64), 1)
                                    };
                                    assert_eq!(
                                        got, want,
                                        "{layout} {format} {} layer {l} page {p} row {r}",
                                        comp.component
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_packed_draft_is_the_tail_layer_of_the_targets_buffers() {
        let g = &geometries()[0];
        let b = CpuBackend::new();
        let pages = 4;
        let host = HostPool::new_with(
            &b,
            g,
            pages,
            HostFormat::sglang(HostLayout::PageFirst, true),
        )
        .unwrap();
        let layouts = host.buffer_layouts();
        assert_eq!(layouts.len(), 2);
        assert_eq!(
            layouts[0].components,
            [Component::TargetLatent, Component::DraftLatent]
        );
        assert_eq!(layouts[0].layers, 5);
        assert_eq!(
            layouts[1].components,
            [Component::TargetIndexer, Component::DraftIndexer]
        );
        assert_eq!((layouts[1].layers, layouts[1].pages), (4, pages + 1));
        assert_eq!(
            host.component_buffer(Component::DraftLatent).unwrap(),
            (0, 4)
        );
        // page_first: a target row is 5 rows (not 4) apart from the next token's.
        let s = host.strides(Component::TargetLatent).unwrap();
        assert_eq!(s.row_stride, 5 * 656);
        assert_eq!(
            host.buffer(Component::DraftLatent).unwrap().addr(),
            host.buffer(Component::TargetLatent).unwrap().addr()
        );
        // The draft's model layer is the target's count, stored layer 0 of its component.
        let draft = &host.components()[2];
        assert_eq!(draft.model_layers, [ModelLayer(4)]);
        // Separate kvshard format: four buffers, each its component alone.
        let own = HostPool::new(&b, g, pages, HostLayout::PageFirst).unwrap();
        assert_eq!(own.buffer_layouts().len(), 4);
        assert_eq!(
            own.strides(Component::TargetLatent).unwrap().row_stride,
            4 * 656
        );
    }

    #[test]
    fn page_spans_are_sglangs_page_buffer_meta() {
        let g = &geometries()[0];
        let b = CpuBackend::new();
        let pages = 6u64;
        let row = 656u64;
        for layout in HostLayout::ALL {
            let host = HostPool::new_with(&b, g, pages, HostFormat::sglang(layout, true)).unwrap();
            let layers = 5u64;
            let spans = host.page_spans(0, LocalPage(3)).unwrap();
            // sglang mla.get_page_buffer_meta: layer_first, per layer
            // `index * D + layer * size * D`; page layouts `index * layer_num * D` for the page's
            // first token `index`, elements of `layer_num * 64 * D` (or 64 * D) bytes.
            let index = 3 * 64;
            let size = pages * 64;
            let want: Vec<(u64, u64)> = match layout {
                HostLayout::LayerFirst => (0..layers)
                    .map(|l| (index * row + l * size * row, 64 * row))
                    .collect(),
                _ => vec![(index * layers * row, layers * 64 * row)],
            };
            assert_eq!(spans, want, "{layout}");
            // dsa.get_page_buffer_meta (page layouts): `page * layer_num * 8448`.
            if layout != HostLayout::LayerFirst {
                let ix = host.page_spans(1, LocalPage(3)).unwrap();
                assert_eq!(ix, vec![(3 * 4 * 8448, 4 * 8448)]);
            }
            // The indexer buffer's extra page is addressable, not beyond.
            assert!(host.page_spans(1, LocalPage(pages)).is_ok());
            assert!(host.page_spans(1, LocalPage(pages + 1)).is_err());
            assert!(host.page_spans(0, LocalPage(pages)).is_err());
        }
    }

    #[test]
    fn wrapping_checks_sizes_and_alignment() {
        let g = &geometries()[1];
        let b = CpuBackend::new();
        let format = HostFormat::sglang(HostLayout::LayerFirst, false);
        let layouts = format.buffers(g, 3).unwrap();
        let memory: Vec<HostMemory> = layouts
            .iter()
            .map(|l| HostMemory {
                memory: b.alloc(l.bytes, MemoryKind::PinnedHost).unwrap(),
                host: None,
            })
            .collect();
        // SAFETY: the backend's own allocations, alive with the pool.
        let host = unsafe { HostPool::wrap(&b, g, 3, format, memory.clone()) }.unwrap();
        assert_eq!(host.bytes(), layouts.iter().map(|l| l.bytes).sum::<usize>());
        let mut short = memory.clone();
        short[1].memory = short[1].memory.slice(0, layouts[1].bytes - 16).unwrap();
        // SAFETY: as above.
        let err = unsafe { HostPool::wrap(&b, g, 3, format, short) }.unwrap_err();
        assert!(err.to_string().contains("target indexer"), "{err}");
        let other = CpuBackend::new();
        // SAFETY: as above (refused: another arena).
        let err = unsafe { HostPool::wrap(&other, g, 3, format, memory.clone()) }.unwrap_err();
        assert!(matches!(err, Error::ForeignMemory { .. }), "{err}");
        // SAFETY: as above (refused: one buffer missing).
        let err = unsafe { HostPool::wrap(&b, g, 3, format, memory[..1].to_vec()) }.unwrap_err();
        assert!(matches!(err, Error::GeometryMismatch { .. }), "{err}");
    }

    /// Fills every block of `pool` with bytes that differ by page, layer, component and seed.
    fn pattern(b: &CpuBackend, pool: &crate::pool::DevicePool, seed: u8) {
        for (c, comp) in pool.components().to_vec().iter().enumerate() {
            for l in 0..comp.layers() {
                for p in 0..pool.pages() {
                    let addr = pool
                        .block_addr(comp.component, StoredLayer(l), LocalPage(p))
                        .unwrap();
                    let bytes: Vec<u8> = (0..comp.block_bytes)
                        .map(|i| {
                            (i as u64 * 7 + p * 31 + l as u64 * 11 + c as u64 * 3) as u8 ^ seed
                        })
                        .collect();
                    // SAFETY: one block of the pool, this arena's memory.
                    let block = unsafe {
                        Buffer::from_raw(
                            addr,
                            comp.block_bytes,
                            MemoryKind::Device,
                            b.address_space(),
                        )
                    };
                    b.write_sync(&block, 0, &bytes).unwrap();
                }
            }
        }
    }

    #[test]
    fn packed_and_adopted_pools_round_trip_through_every_direct_route() {
        use crate::copy::Direction;
        use crate::copy::{Layers, Method};
        use crate::hicache::{HostTransfer, TransferPlan};
        use crate::index::LogicalPage;
        use crate::pool::DevicePool;
        use crate::shard::Placement;

        let b = CpuBackend::new();
        let g = &geometries()[0];
        let placement = Placement::new(2).unwrap();
        let (dev_pages, host_pages) = (8u64, 7u64);
        let device = Arc::new(DevicePool::allocate(&b, g, placement, 1, dev_pages).unwrap());
        pattern(&b, &device, 0x5a);
        // Rank 1's logical pages 3, 5, 7, 11 and 13 (local 1, 2, 3, 5, 6) to host pages 13, 9,
        // 3, 5, 7 (local 6, 4, 1, 2, 3); logical pages 4 and 6 belong to rank 0.
        let dev = [3u64, 5, 7, 4, 11, 13].map(LogicalPage);
        let hst = [13u64, 9, 3, 6, 5, 7].map(LogicalPage);
        let plan = || TransferPlan::new(placement, 1, &dev, &hst, dev_pages, host_pages).unwrap();
        let ios = [
            Method::host_io(&b, 2),
            Method::CopyEngine,
            Method::PerBlock,
            Method::BatchedCopyEngine,
        ];
        let mut reference: Option<Vec<u8>> = None;
        for layout in HostLayout::ALL {
            for format in [
                HostFormat::kvshard(layout),
                HostFormat::sglang(layout, false),
                HostFormat::sglang(layout, true),
            ] {
                // Engine memory (plain heap bytes) adopted into the arena and wrapped.
                let memory: Vec<HostMemory> = format
                    .buffers(g, host_pages)
                    .unwrap()
                    .iter()
                    .map(|l| {
                        // Engine memory: a heap block the arena reaches through its pointer.
                        let layout = std::alloc::Layout::from_size_align(l.bytes, 64).unwrap();
                        struct Keep(*mut u8, std::alloc::Layout);
                        // SAFETY: the block is only reached through the arena in this test.
                        unsafe impl Send for Keep {}
                        // SAFETY: as Send.
                        unsafe impl Sync for Keep {}
                        impl Drop for Keep {
                            fn drop(&mut self) {
                                // SAFETY: allocated below with this layout, dropped once.
                                unsafe { std::alloc::dealloc(self.0, self.1) }
                            }
                        }
                        // SAFETY: a non-zero size.
                        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
                        assert!(!ptr.is_null());
                        let keep = Arc::new(Keep(ptr, layout));
                        // SAFETY: `l.bytes` live bytes kept alive by `keep`, touched only
                        // through the arena.
                        let buffer =
                            unsafe { b.adopt_raw(ptr, l.bytes, MemoryKind::PinnedHost, keep) }
                                .unwrap();
                        assert_eq!(b.host_ptr(&buffer).unwrap(), ptr);
                        HostMemory {
                            memory: buffer,
                            host: Some(ptr),
                        }
                    })
                    .collect();
                // SAFETY: adopted memory of this arena, alive with its buffers.
                let host =
                    Arc::new(unsafe { HostPool::wrap(&b, g, host_pages, format, memory) }.unwrap());
                for io in ios {
                    host.fill(&b, 0xee).unwrap();
                    let mut backup =
                        HostTransfer::new(device.clone(), host.clone(), plan(), Direction::Backup)
                            .unwrap();
                    backup.prepare_kernel_sync(&b, &mut Vec::new()).unwrap();
                    backup.run(&b, io, Layers::All).unwrap();
                    b.synchronize().unwrap();
                    let snap = host.snapshot_sync(&b).unwrap();
                    match &reference {
                        None => reference = Some(snap),
                        Some(r) => assert!(*r == snap, "{format} {io}: backup differs"),
                    }
                    // Reload into a fresh pool, layer by layer, and compare the moved pages.
                    let back =
                        Arc::new(DevicePool::allocate(&b, g, placement, 1, dev_pages).unwrap());
                    back.fill(&b, 0x11).unwrap();
                    let mut load =
                        HostTransfer::new(back.clone(), host.clone(), plan(), Direction::Load)
                            .unwrap();
                    load.prepare_kernel_sync(&b, &mut Vec::new()).unwrap();
                    for m in 0..g.model_layers() {
                        load.run(&b, io, Layers::One(ModelLayer(m))).unwrap();
                    }
                    let moved = [1u64, 2, 3, 5, 6].map(LocalPage);
                    assert!(
                        back.read_pages_sync(&b, &moved).unwrap()
                            == device.read_pages_sync(&b, &moved).unwrap(),
                        "{format} {io}: reload differs"
                    );
                }
            }
        }
    }

    #[test]
    fn the_staged_mirror_refuses_a_packed_page_major_pool() {
        let g = &geometries()[0];
        let b = CpuBackend::new();
        for layout in HostLayout::ALL {
            let packed = HostPool::new_with(&b, g, 4, HostFormat::sglang(layout, true)).unwrap();
            let mirror = HostPool::device_mirror(&b, &packed, 2);
            assert_eq!(mirror.is_ok(), layout == HostLayout::LayerFirst, "{layout}");
            let separate = HostPool::new_with(&b, g, 4, HostFormat::sglang(layout, false)).unwrap();
            assert!(HostPool::device_mirror(&b, &separate, 2).is_ok());
        }
    }
}
