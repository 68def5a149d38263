//! Executing send plans. A [`DescriptorBatch`] resolves a plan's relative offsets against the
//! per-layer base addresses of the source and destination into absolute `(src, dst, bytes)`
//! ranges: exactly what a network transfer engine moves (NIXL and Mooncake register memory
//! regions, then take lists of address/length pairs), so a [`Transport`] for one of them
//! executes the same batches as the in-process ones here.
//!
//! [`BackendTransport`] executes batches whose source and destination live in one backend
//! address space (the same GPU, peer GPUs of one process, or the CPU reference's arena):
//! - [`CopyMethod::Kernel`]: one `kvs_copy_ranges` launch per batch, all layers and components
//!   together. The kernel gives each range one warp, so ranges longer than
//!   [`KERNEL_PIECE_BYTES`] are split first: a coalesced run of a whole layer would otherwise
//!   leave one warp copying megabytes while the rest of the grid idles.
//! - [`CopyMethod::CopyEngine`]: one `memcpy_batch` call (`cudaMemcpyBatchAsync`), which leaves
//!   the SMs to the forward pass.
//! - [`CopyMethod::Blocks`]: one `kvs_copy_blocks` launch per section from the batch's page
//!   lists and per-layer bases. Owned pages of a rank sit N apart on the decode side, so runs
//!   rarely coalesce and the range table of a 4,096-page chunk is ~12 MB; page lists are 16
//!   bytes a page, so the per-chunk upload no longer rivals the copy itself.
//!
//! On the [`CpuBackend`](crate::backend::cpu::CpuBackend) all three run the CPU twins: that is
//! the reference the GPU paths are compared with.

use std::fmt;
use std::marker::PhantomData;

use super::plan::{PageRun, SectionComponent, SendPlan};
use super::ComponentBytes;
use crate::abi;
use crate::backend::{Backend, Buffer, Launch, MemoryKind};
use crate::error::{Error, Result};
use crate::pool::BlockSpace;

/// Longest range one warp of `kvs_copy_ranges` copies: 64 iterations of the warp's 4 KB
/// (32 lanes x 8 loads of 16 bytes in flight). Short enough that a batch of coalesced runs
/// spreads over the whole grid, long enough that the per-range overhead stays negligible.
pub const KERNEL_PIECE_BYTES: u64 = 256 << 10;

/// Bytes of one `kvs_range` table entry.
const RANGE_BYTES: usize = std::mem::size_of::<abi::kvs_range>();

/// `ranges` cut into consecutive pieces of at most [`KERNEL_PIECE_BYTES`], in order: the
/// table [`CopyMethod::Kernel`] launches over. Empty ranges yield no piece.
pub fn kernel_pieces(ranges: &[abi::kvs_range]) -> impl Iterator<Item = abi::kvs_range> + '_ {
    ranges.iter().flat_map(|r| {
        (0..r.bytes.div_ceil(KERNEL_PIECE_BYTES)).map(move |k| {
            let offset = k * KERNEL_PIECE_BYTES;
            abi::kvs_range {
                src: r.src + offset,
                dst: r.dst + offset,
                bytes: (r.bytes - offset).min(KERNEL_PIECE_BYTES),
            }
        })
    })
}

/// A plan resolved against its source and destination: the absolute ranges to move. It
/// borrows both spaces, so they outlive it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescriptorBatch<'a> {
    request: u64,
    rank: u32,
    chunk: u32,
    last: bool,
    ranges: Vec<abi::kvs_range>,
    blocks: Vec<BlockSection>,
    bytes: ComponentBytes,
    _spaces: PhantomData<&'a ()>,
}

/// One section of a batch in `kvs_copy_blocks` form: per-layer base pairs and page lists, so a
/// kernel resolves addresses itself and the upload is 16 bytes per page instead of 24 bytes per
/// (run, layer).
#[derive(Debug, Clone, PartialEq, Eq)]
struct BlockSection {
    components: Vec<abi::kvs_block_component>,
    pairs: Vec<abi::kvs_layer_pair>,
    src_pages: Vec<i64>,
    dst_pages: Vec<i64>,
    src_limit: u64,
    dst_limit: u64,
}

/// Index of `c` in `space`, after checking the space stores it the way the plan assumes and
/// holds the `pages` pages (one past the highest) the runs address.
fn locate(
    plan: &SendPlan,
    space: &dyn BlockSpace,
    c: &SectionComponent,
    side: &str,
    pages: u64,
) -> Result<usize> {
    let fail = |reason: String| {
        Err(Error::Transfer {
            request: plan.request,
            reason,
        })
    };
    let Some(i) = space
        .components()
        .iter()
        .position(|l| l.component == c.component)
    else {
        return fail(format!("the {side} holds no {}", c.component));
    };
    let layout = &space.components()[i];
    if layout.layers() != c.layers {
        return fail(format!(
            "the {side} holds {} {} layers, the plan moves {}",
            layout.layers(),
            c.component,
            c.layers
        ));
    }
    let block = space.block_side(i);
    if block.page_stride != c.item || block.row_stride != layout.row_bytes as u64 {
        return fail(format!(
            "packed page stride mismatch: the {side} stores {} pages {} B apart (rows {} B apart), the plan moves packed {} B blocks",
            c.component, block.page_stride, block.row_stride, c.item
        ));
    }
    if space.pages() < pages {
        return fail(format!(
            "the plan moves {} pages up to page {}, the {side} holds {} pages per layer",
            c.component,
            pages - 1,
            space.pages()
        ));
    }
    Ok(i)
}

/// One past the highest page `runs` address on each side, or `None` when that overflows.
fn page_ends(runs: &[PageRun]) -> Option<(u64, u64)> {
    runs.iter().try_fold((0u64, 0u64), |(s, d), r| {
        Some((
            s.max(r.src.checked_add(r.pages)?),
            d.max(r.dst.checked_add(r.pages)?),
        ))
    })
}

impl<'a> DescriptorBatch<'a> {
    /// Resolves `plan` against `src` (the sending rank's pool) and `dst` (the decode pool, or a
    /// description of its registered memory), after checking both hold what the plan was made
    /// for: the same components and layers, packed, with at least the pages it was checked
    /// against.
    pub fn resolve(
        plan: &SendPlan,
        src: &'a dyn BlockSpace,
        dst: &'a dyn BlockSpace,
    ) -> Result<Self> {
        let mut ranges = Vec::with_capacity(plan.descriptor_count());
        let mut blocks = Vec::new();
        for section in plan.sections() {
            // Plans are plain data: every run is checked against the spaces here, so no range
            // of the batch leaves its (component, layer) buffer whatever the plan holds.
            let Some((src_end, dst_end)) = page_ends(&section.runs) else {
                return Err(Error::Transfer {
                    request: plan.request,
                    reason: "a run's pages overflow".into(),
                });
            };
            let mut block = BlockSection {
                components: Vec::new(),
                pairs: Vec::new(),
                src_pages: Vec::new(),
                dst_pages: Vec::new(),
                src_limit: src.pages(),
                dst_limit: dst.pages(),
            };
            for (k, c) in section.components.iter().enumerate() {
                let si = locate(plan, src, c, "source", src_end)?;
                let di = locate(plan, dst, c, "destination", dst_end)?;
                let packed = abi::kvs_block_side {
                    page_stride: c.item,
                    row_stride: c.item,
                };
                block.components.push(abi::kvs_block_component {
                    rows: 1,
                    row_bytes: c.item as u32,
                    src: packed,
                    dst: packed,
                });
                for layer in 0..c.layers {
                    let (s, d) = (src.layer_base(si, layer), dst.layer_base(di, layer));
                    ranges.extend(section.runs.iter().map(|run| abi::kvs_range {
                        src: s + run.src * c.item,
                        dst: d + run.dst * c.item,
                        bytes: run.pages * c.item,
                    }));
                    block.pairs.push(abi::kvs_layer_pair {
                        src: s,
                        dst: d,
                        component: k as u32,
                        signal: 0,
                    });
                }
            }
            for run in &section.runs {
                block
                    .src_pages
                    .extend((run.src..run.src + run.pages).map(|p| p as i64));
                block
                    .dst_pages
                    .extend((run.dst..run.dst + run.pages).map(|p| p as i64));
            }
            if !block.src_pages.is_empty() && !block.pairs.is_empty() {
                blocks.push(block);
            }
        }
        Ok(Self {
            request: plan.request,
            rank: plan.rank,
            chunk: plan.chunk.index,
            last: plan.chunk.last,
            ranges,
            blocks,
            bytes: plan.bytes(),
            _spaces: PhantomData,
        })
    }

    /// Request id.
    pub fn request(&self) -> u64 {
        self.request
    }

    /// The sending prefill rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Index of the chunk in the request's send order.
    pub fn chunk(&self) -> u32 {
        self.chunk
    }

    /// Whether this is the request's final chunk.
    pub fn is_last(&self) -> bool {
        self.last
    }

    /// The absolute ranges, in the plan's descriptor order.
    pub fn ranges(&self) -> &[abi::kvs_range] {
        &self.ranges
    }

    /// Whether the batch moves nothing (the rank still reports the chunk).
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Bytes the batch moves, per component.
    pub fn bytes(&self) -> ComponentBytes {
        self.bytes
    }
}

impl fmt::Display for DescriptorBatch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "request {} rank {} chunk {}{}: {} ranges, {}",
            self.request,
            self.rank,
            self.chunk,
            if self.last { " final" } else { "" },
            self.ranges.len(),
            self.bytes
        )
    }
}

/// Something that moves descriptor batches: an in-process backend, or a network transfer
/// engine (NIXL, Mooncake) that posts the ranges in `submit` and polls them in `wait`.
///
/// The spaces a batch was resolved against must stay alive until `wait` has returned:
/// [`Sender`](super::Sender) waits for every chunk before it reports the chunk's status.
pub trait Transport {
    /// Starts moving every range of `batch`; ranges may land in any order. An empty batch is
    /// valid and moves nothing.
    fn submit(&mut self, batch: &DescriptorBatch<'_>) -> Result<()>;

    /// Waits until everything submitted so far has landed, or returns the first failure.
    fn wait(&mut self) -> Result<()>;
}

/// How a [`BackendTransport`] moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyMethod {
    /// One `kvs_copy_ranges` launch per batch with this grid, ranges split into pieces of at
    /// most [`KERNEL_PIECE_BYTES`].
    Kernel(Launch),
    /// One `memcpy_batch` call per batch (`cudaMemcpyBatchAsync` on the GPU).
    CopyEngine,
    /// One `kvs_copy_blocks` launch per section (the latent KV; with the final chunk, the
    /// indexer state) with this grid, from page lists: the smallest upload of the three.
    Blocks(Launch),
}

/// Executes batches on a [`Backend`] whose address space holds both the source and the
/// destination, in the backend's stream order.
pub struct BackendTransport<'b, B: Backend> {
    backend: &'b B,
    method: CopyMethod,
    /// Host copy of the kernel's range table, reused from batch to batch.
    staged: Vec<u8>,
    /// Device copy of the range table, grown when a batch needs more and otherwise reused:
    /// [`Backend::enqueue_write`] is ordered after the previous launch that reads it.
    table: Option<Buffer>,
    /// Tables replaced by larger ones since the last `wait`.
    retired: Vec<Buffer>,
}

impl<B: Backend> fmt::Debug for BackendTransport<'_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendTransport")
            .field("backend", &self.backend.name())
            .field("method", &self.method)
            .finish_non_exhaustive()
    }
}

impl<'b, B: Backend> BackendTransport<'b, B> {
    /// A transport enqueuing on `backend` with `method`.
    pub fn new(backend: &'b B, method: CopyMethod) -> Self {
        Self {
            backend,
            method,
            staged: Vec::new(),
            table: None,
            retired: Vec::new(),
        }
    }

    /// How this transport moves bytes.
    pub fn method(&self) -> CopyMethod {
        self.method
    }

    /// Uploads `staged` into the reusable device table (stream-ordered after the launches that
    /// read its previous contents) and returns its address.
    fn upload_staged(&mut self) -> Result<u64> {
        let table = match self.table.take() {
            Some(t) if t.len() >= self.staged.len() => t,
            old => {
                // A launch not yet waited for may still read the old table: keep it until then.
                self.retired.extend(old);
                self.backend.alloc(
                    self.staged.len().next_power_of_two().max(64 * RANGE_BYTES),
                    MemoryKind::Device,
                )?
            }
        };
        // Stream-ordered and non-blocking: the previous launch reading this table comes first.
        let written = self.backend.enqueue_write(&table, 0, &self.staged);
        let addr = table.addr();
        self.table = Some(table);
        written.map(|()| addr)
    }

    /// Launches `kvs_copy_blocks` over one section's pairs and page lists.
    fn launch_blocks(&mut self, section: &BlockSection, launch: Launch) -> Result<()> {
        self.staged.clear();
        crate::backend::extend_pair_table(&mut self.staged, &section.pairs);
        let src_at = self.staged.len() as u64;
        for id in section.src_pages.iter().chain(&section.dst_pages) {
            self.staged.extend_from_slice(&id.to_le_bytes());
        }
        let base = self.upload_staged()?;
        let n = section.src_pages.len() as u64;
        let list = abi::kvs_page_list::local;
        let mut components =
            [abi::kvs_block_component::default(); abi::KVS_MAX_COMPONENTS as usize];
        components[..section.components.len()].copy_from_slice(&section.components);
        let params = abi::kvs_copy_blocks_params {
            components,
            pairs: base,
            num_pages: n,
            src_pages: list(base + src_at, section.src_limit),
            dst_pages: list(base + src_at + 8 * n, section.dst_limit),
            signals: 0,
            num_pairs: section.pairs.len() as u32,
            num_components: section.components.len() as u32,
            work: abi::kvs_work_queue::default(),
            status: abi::kvs_status::default(),
        };
        // SAFETY: pairs are the (component, layer) bases of the batch's spaces, checked by
        // `DescriptorBatch::resolve` against the spaces' layers, packed strides and pages (the
        // limits bound every page the kernel touches); the table is ours and stream-ordered.
        unsafe { self.backend.copy_blocks(params, launch) }
    }

    /// Launches `kvs_copy_ranges` over `ranges`, split into kernel pieces.
    fn launch(&mut self, ranges: &[abi::kvs_range], launch: Launch) -> Result<()> {
        self.staged.clear();
        let mut pieces = 0u64;
        for piece in kernel_pieces(ranges) {
            for word in [piece.src, piece.dst, piece.bytes] {
                self.staged.extend_from_slice(&word.to_le_bytes());
            }
            pieces += 1;
        }
        if pieces == 0 {
            return Ok(());
        }
        let addr = self.upload_staged()?;
        let params = abi::kvs_copy_ranges_params {
            ranges: addr,
            num_ranges: pieces,
        };
        // SAFETY: every range lies inside a (component, layer) buffer of the batch's spaces
        // (`DescriptorBatch::resolve` checked every run against the spaces' pages, layers and
        // block strides); the spaces outlive the copy (the Transport contract: alive until
        // `wait`); the table is ours and only a later, stream-ordered `write` rewrites it.
        unsafe { self.backend.copy_ranges(params, launch) }
    }
}

impl<B: Backend> Transport for BackendTransport<'_, B> {
    fn submit(&mut self, batch: &DescriptorBatch<'_>) -> Result<()> {
        match self.method {
            CopyMethod::Kernel(launch) => self.launch(batch.ranges(), launch),
            // SAFETY: as in `launch`; the backend reads the range list before returning.
            CopyMethod::CopyEngine => unsafe { self.backend.memcpy_batch(batch.ranges()) },
            CopyMethod::Blocks(launch) => batch
                .blocks
                .iter()
                .try_for_each(|section| self.launch_blocks(section, launch)),
        }
    }

    fn wait(&mut self) -> Result<()> {
        self.backend.synchronize()?;
        // Nothing submitted can still be reading a retired table.
        self.retired.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
    use crate::pool::DevicePool;
    use crate::shard::Placement;
    use crate::synth::POISON;
    use crate::transfer::{ChunkRange, PoolLayout, PrefillRank, Registration};

    fn geometry() -> CacheGeometry {
        CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 2))
    }

    /// Rank 0 of 2 sends positions 0..40 (logical pages 2..42: it owns the even positions,
    /// local pages 1..=20) into decode pages 1..=20 (even positions) and 30..=49 (odd ones), so
    /// its 20 pages coalesce into one run.
    fn setup(b: &CpuBackend) -> (DevicePool, DevicePool, SendPlan) {
        let g = geometry();
        let src = DevicePool::allocate(b, &g, Placement::new(2).unwrap(), 0, 48).unwrap();
        let dst = DevicePool::allocate(b, &g, Placement::unsharded(), 0, 64).unwrap();
        let src_pages: Vec<u64> = (0..40).map(|p| 2 + p).collect();
        let dst_pages: Vec<u64> = (0..40)
            .map(|p| if p % 2 == 0 { 1 + p / 2 } else { 30 + p / 2 })
            .collect();
        let reg = Registration {
            request: 3,
            layout: PoolLayout::of(&dst),
            prefix_pages: 0,
            pages: dst_pages.clone(),
            state_pages: dst_pages,
        };
        let plan = SendPlan::new(
            &PrefillRank::of(&src),
            &src_pages,
            &reg,
            ChunkRange {
                index: 0,
                start: 0,
                end: 40 * 64,
                last: true,
            },
        )
        .unwrap();
        assert_eq!(plan.kv.runs.len(), 1);
        (src, dst, plan)
    }

    #[test]
    fn kernel_pieces_tile_each_range_exactly() {
        let piece = KERNEL_PIECE_BYTES;
        let ranges = [
            abi::kvs_range {
                src: 0x1000,
                dst: 0x9000_0000,
                bytes: 2 * piece + 48,
            },
            abi::kvs_range {
                src: 0x5000_0000,
                dst: 0x7000,
                bytes: 0,
            },
            abi::kvs_range {
                src: 0x6000_0000,
                dst: 0x8000,
                bytes: piece,
            },
        ];
        let pieces: Vec<_> = kernel_pieces(&ranges).collect();
        let expect = |src, dst, bytes| abi::kvs_range { src, dst, bytes };
        assert_eq!(
            pieces,
            vec![
                expect(0x1000, 0x9000_0000, piece),
                expect(0x1000 + piece, 0x9000_0000 + piece, piece),
                expect(0x1000 + 2 * piece, 0x9000_0000 + 2 * piece, 48),
                expect(0x6000_0000, 0x8000, piece),
            ]
        );
    }

    #[test]
    fn batches_resolve_offsets_against_layer_bases() {
        let b = CpuBackend::new();
        let (src, dst, plan) = setup(&b);
        let batch = DescriptorBatch::resolve(&plan, &src, &dst).unwrap();
        assert_eq!(batch.ranges().len(), plan.descriptor_count());
        assert_eq!(batch.bytes(), plan.bytes());
        let summed: u64 = batch.ranges().iter().map(|r| r.bytes).sum();
        assert_eq!(summed, plan.bytes().total());
        for (r, d) in batch.ranges().iter().zip(plan.descriptors()) {
            let c = src
                .components()
                .iter()
                .position(|l| l.component == d.component)
                .unwrap();
            assert_eq!(r.src, src.layer_bases(c)[d.layer] + d.src_offset);
            assert_eq!(r.dst, dst.layer_bases(c)[d.layer] + d.dst_offset);
            assert_eq!(r.bytes, d.bytes);
        }
        assert!(batch
            .to_string()
            .starts_with("request 3 rank 0 chunk 0 final:"));
    }

    #[test]
    fn batches_refuse_spaces_the_plan_was_not_made_for() {
        let b = CpuBackend::new();
        let (src, dst, plan) = setup(&b);
        let small = DevicePool::allocate(&b, &geometry(), Placement::unsharded(), 0, 8).unwrap();
        let e = DescriptorBatch::resolve(&plan, &src, &small)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("request 3: the plan moves target latent pages up to page 20, the destination holds 8 pages per layer"),
            "{e}"
        );
        let other = CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 2));
        let no_draft = DevicePool::allocate(&b, &other, Placement::unsharded(), 0, 64).unwrap();
        let e = DescriptorBatch::resolve(&plan, &src, &no_draft)
            .unwrap_err()
            .to_string();
        assert!(e.contains("the destination holds no draft latent"), "{e}");
        let three = CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 3));
        let deeper = DevicePool::allocate(&b, &three, Placement::new(2).unwrap(), 0, 48).unwrap();
        let e = DescriptorBatch::resolve(&plan, &deeper, &dst)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the source holds 3 target latent layers, the plan moves 2"),
            "{e}"
        );
        // Staging stores blocks packed like a pool: a plan runs from it if it holds the pages.
        let staging = crate::pool::Staging::new(&b, &geometry(), 21).unwrap();
        assert!(DescriptorBatch::resolve(&plan, &staging, &dst).is_ok());
        let staging = crate::pool::Staging::new(&b, &geometry(), 20).unwrap();
        let e = DescriptorBatch::resolve(&plan, &staging, &dst)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("up to page 20, the source holds 20 pages"),
            "{e}"
        );
        // Plans are plain data: an edited run past the pool is refused too.
        let mut edited = plan.clone();
        edited.state.runs[0].pages = 60;
        let e = DescriptorBatch::resolve(&edited, &src, &dst)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the plan moves target indexer pages up to page 60, the source holds 48"),
            "{e}"
        );
        edited.state.runs[0].pages = u64::MAX;
        assert!(DescriptorBatch::resolve(&edited, &src, &dst).is_err());
    }

    #[test]
    fn kernel_pieces_split_long_ranges_and_both_methods_copy_the_same_bytes() {
        let b = CpuBackend::new();
        let mut outs = Vec::new();
        for method in [
            CopyMethod::Kernel(Launch {
                ctas: 4,
                threads: 128,
            }),
            CopyMethod::CopyEngine,
        ] {
            let (src, dst, plan) = setup(&b);
            let storage = src.storage().unwrap();
            let data: Vec<u8> = (0..storage.len()).map(|i| (i * 7 % 251) as u8).collect();
            b.write(storage, 0, &data).unwrap();
            dst.fill(&b, POISON).unwrap();
            let batch = DescriptorBatch::resolve(&plan, &src, &dst).unwrap();
            // The coalesced latent run (20 pages, 720 KB) is longer than a kernel piece.
            assert!(batch.ranges().iter().any(|r| r.bytes > KERNEL_PIECE_BYTES));
            let mut t = BackendTransport::new(&b, method);
            t.submit(&batch).unwrap();
            t.wait().unwrap();
            outs.push(dst.snapshot(&b).unwrap());
        }
        assert!(outs[0] == outs[1], "kernel and copy engine differ");
        // 20 of 64 pages of every layer landed; the rest stays poisoned.
        let landed = outs[0].iter().filter(|&&x| x != POISON).count();
        assert!(landed > 0 && landed < outs[0].len() / 2, "{landed}");
    }
}
