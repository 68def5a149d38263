//! Whole-chunk bounce buffers, for transfer engines that post one descriptor per chunk and rank
//! (Mooncake's, through the Python package): the prefill rank packs every owned block of a
//! chunk into one contiguous buffer with block copies ([`BounceBuffer::pack`]), the engine moves
//! that one range into the decode side's bounce buffer, and the decode scatters it into its
//! pool pages ([`BounceBuffer::scatter`]) from the [`PackedSection`]s the prefill reports.
//!
//! **Layout.** Sections follow each other in send order (latent KV, then the indexer state of
//! the final chunk); inside a section, each of its components takes `k` pages of every stored
//! layer, layer-major (`[component][layer][page][block]`, `k` the section's owned pages), its
//! region rounded up to 256 bytes. Only the section's own components take room, so the packed
//! prefix is the chunk's bytes plus at most 255 bytes of padding per component: one range,
//! whatever the chunk. Both sides compute the layout from the same (components, `k`) list, so
//! nothing but that list crosses the wire.
//!
//! NIXL keeps its own per-component slots (`nixl::registration`), sized once and prepared as
//! descriptor lists by prefix length: NIXL indexes prepared lists, Mooncake takes raw ranges.

use std::fmt;
use std::sync::Arc;

use super::plan::SendPlan;
use crate::abi;
use crate::backend::{AddressSpace, Backend, Buffer, Event, KernelFamily, Launch};
use crate::copy::space::{sealed, REGION_ALIGN};
use crate::copy::{BlockCopyPlan, BlockSpace, PageSelection, SpaceId, TableStore};
use crate::error::{Checked, Error, Result};
use crate::geometry::{CacheGeometry, Component, ComponentLayout};
use crate::index::LocalPage;
use crate::pool::DevicePool;

/// One section of a packed chunk: the components it holds, and the decode's destination page of
/// each packed entry, in entry order (what the decode side scatters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedSection {
    /// Components of the section, in send order.
    pub components: Vec<Component>,
    /// Destination page of entry `j`.
    pub pages: Vec<LocalPage>,
}

/// A chunk packed into a [`BounceBuffer`]: the bytes of its one range (from the buffer's
/// start), its sections, and the event after which the packing has run.
#[derive(Debug)]
pub struct Packed {
    /// Bytes of the packed range, padding included.
    pub bytes: u64,
    /// The sections, in the buffer's order.
    pub sections: Vec<PackedSection>,
    /// Recorded after the packing copies: the engine may read the buffer once it has passed.
    pub event: Event,
}

/// One section's region of a bounce buffer, as a block space: every component of the cache
/// (so a block copy can pair it with a pool), of which only the section's own take room.
struct SectionSpace {
    id: SpaceId,
    space: AddressSpace,
    components: Vec<ComponentLayout>,
    pages: u64,
    /// Byte offset of each component's region in `buffer` (0 for a component not in the
    /// section: the copy keeps none of its pairs).
    offsets: Vec<usize>,
    buffer: Buffer,
}

impl fmt::Debug for SectionSpace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SectionSpace")
            .field("id", &self.id)
            .field("pages", &self.pages)
            .field("bytes", &self.buffer.len())
            .finish_non_exhaustive()
    }
}

impl sealed::Sealed for SectionSpace {
    fn base(&self, c: usize, layer: usize) -> u64 {
        let comp = &self.components[c];
        self.buffer.addr()
            + (self.offsets[c] + layer * self.pages as usize * comp.block_bytes) as u64
    }

    fn side(&self, c: usize) -> abi::kvs_block_side {
        self.components[c].packed_side()
    }

    fn layer_count(&self, c: usize) -> usize {
        self.components[c].layers()
    }

    fn usage(&self) -> &crate::backend::Usage {
        self.buffer.usage()
    }
}

crate::copy::space::block_space!(SectionSpace);

/// Where each section of a chunk lies: per section, each component's offset (0 when absent)
/// and the section's end, from the buffer's start; `all` are the cache's components.
fn layout(
    all: &[ComponentLayout],
    sections: &[(Vec<Component>, u64)],
) -> Result<Vec<(Vec<usize>, usize, usize)>> {
    let mut at = 0usize;
    let mut out = Vec::with_capacity(sections.len());
    for (components, k) in sections {
        let what = || format!("a packed section of {k} pages");
        let start = at;
        let mut offsets = vec![0usize; all.len()];
        for &component in components {
            let c = all
                .iter()
                .position(|l| l.component == component)
                .ok_or_else(|| Error::InvalidArgument(format!("the cache holds no {component}")))?;
            offsets[c] = at;
            at = crate::error::to_usize(*k, what)?
                .mul_or(all[c].page_bytes(), what)?
                .add_or(at, what)?
                .checked_next_multiple_of(REGION_ALIGN)
                .ok_or_else(|| Error::overflow(what()))?;
        }
        out.push((offsets, start, at));
    }
    Ok(out)
}

/// A contiguous buffer one chunk at a time is packed into (prefill side) or scattered from
/// (decode side), with the block copies that do it, on one backend's stream. Register it with
/// the transfer engine once and reuse it; its [`BounceBuffer::buffer`] stays where it is.
pub struct BounceBuffer {
    components: Vec<ComponentLayout>,
    pages: u64,
    buffer: Buffer,
    store: TableStore,
    launch: Launch,
}

impl fmt::Debug for BounceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BounceBuffer")
            .field("pages", &self.pages)
            .field("bytes", &self.buffer.len())
            .finish_non_exhaustive()
    }
}

impl BounceBuffer {
    /// A buffer for chunks whose sections own at most `pages` pages each, in `backend`'s
    /// device memory; the copies run on `backend`'s stream.
    pub fn new(backend: Arc<dyn Backend>, geometry: &CacheGeometry, pages: u64) -> Result<Self> {
        geometry.validate()?;
        if pages == 0 {
            return Err(Error::InvalidArgument(
                "a bounce buffer of 0 pages holds no chunk".into(),
            ));
        }
        let components = geometry.components();
        let all: Vec<Component> = components.iter().map(|c| c.component).collect();
        // Every section holds a subset of the components with at most `pages` pages: no chunk
        // packs to more than every component at `pages` pages.
        let bytes = layout(&components, &[(all, pages)])?
            .last()
            .map_or(0, |s| s.2);
        // Registrable: the transfer engine registers it by address (GPUDirect RDMA among them).
        let buffer = backend.alloc_registrable(bytes.max(1))?;
        let launch = Launch {
            ctas: 264,
            threads: backend.max_threads(KernelFamily::Copy).min(512),
        };
        Ok(Self {
            components,
            pages,
            buffer,
            store: TableStore::new(backend),
            launch,
        })
    }

    /// The buffer (its address is the backend's: the CPU backend's host address comes from
    /// `CpuBackend::host_address`).
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }

    /// Pages per section the buffer holds.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Bytes `plan` packs to, or `None` when a section owns more than [`BounceBuffer::pages`]
    /// pages (the chunk goes unpacked) or the plan moves nothing.
    pub fn packed_bytes(&self, plan: &SendPlan) -> Option<u64> {
        let sections = Self::sections_of(plan);
        if sections.is_empty() || sections.iter().any(|s| s.1 > self.pages) {
            return None;
        }
        let laid = layout(&self.components, &sections).ok()?;
        laid.last().map(|s| s.2 as u64)
    }

    fn sections_of(plan: &SendPlan) -> Vec<(Vec<Component>, u64)> {
        plan.sections()
            .into_iter()
            .filter(|s| !s.is_empty())
            .map(|s| {
                (
                    s.components().iter().map(|c| c.component).collect(),
                    s.owned_pages() as u64,
                )
            })
            .collect()
    }

    /// The block space of one laid-out section.
    fn section_space(
        &self,
        offsets: Vec<usize>,
        start: usize,
        end: usize,
        k: u64,
    ) -> Result<Arc<SectionSpace>> {
        // Offsets are from the buffer's start; the space's buffer is the section's slice.
        let offsets = offsets
            .into_iter()
            .map(|o| o.saturating_sub(start))
            .collect();
        Ok(Arc::new(SectionSpace {
            id: SpaceId::next(),
            space: self.buffer.space(),
            components: self.components.clone(),
            pages: k,
            offsets,
            buffer: self.buffer.slice(start, end - start)?,
        }))
    }

    /// Enqueues the packing of every owned block of `plan` from `src` (this rank's pool) into
    /// the buffer, from its start. Refused when the plan moves nothing, a section owns more
    /// pages than the buffer holds, or the plan does not fit `src`. The caller must not pack
    /// again before the engine has moved the packed range.
    pub fn pack(&mut self, plan: &SendPlan, src: &Arc<DevicePool>) -> Result<Packed> {
        let sections = Self::sections_of(plan);
        if self.packed_bytes(plan).is_none() {
            return Err(Error::InvalidArgument(format!(
                "{plan} does not fit a bounce buffer of {} pages per section",
                self.pages
            )));
        }
        let laid = layout(&self.components, &sections)?;
        let src_space: Arc<dyn BlockSpace> = src.clone();
        let mut packed = Vec::new();
        let mut bytes = 0;
        for (section, (offsets, start, end)) in plan
            .sections()
            .into_iter()
            .filter(|s| !s.is_empty())
            .zip(laid)
        {
            let owned = section.owned();
            let space = self.section_space(offsets, start, end, owned.len() as u64)?;
            let comps: Vec<Component> = section.components().iter().map(|c| c.component).collect();
            let copy = BlockCopyPlan::new(
                src.as_ref(),
                PageSelection::Local(owned.src_pages().to_vec()),
                space.as_ref(),
                PageSelection::Positions,
                owned.len(),
            )?
            .only_components(src.as_ref(), &comps);
            let dst_space: Arc<dyn BlockSpace> = space;
            self.store
                .launch(&copy, &src_space, &dst_space, self.launch)?;
            packed.push(PackedSection {
                components: comps,
                pages: owned.dst_pages().to_vec(),
            });
            bytes = end as u64;
        }
        Ok(Packed {
            bytes,
            sections: packed,
            event: self.store.backend().record()?,
        })
    }

    /// Enqueues the scatter of a chunk packed as `sections` describe (what the prefill's
    /// [`Packed::sections`] reported) from the buffer's start into `dst` (this side's pool);
    /// returns the event after which the pages hold it. Every page is checked against `dst`
    /// before anything is enqueued.
    pub fn scatter(&mut self, sections: &[PackedSection], dst: &Arc<DevicePool>) -> Result<Event> {
        let shape: Vec<(Vec<Component>, u64)> = sections
            .iter()
            .map(|s| (s.components.clone(), s.pages.len() as u64))
            .collect();
        if let Some(s) = shape.iter().find(|s| s.1 > self.pages) {
            return Err(Error::InvalidArgument(format!(
                "a packed section of {} pages; the bounce buffer holds {}",
                s.1, self.pages
            )));
        }
        let laid = layout(&self.components, &shape)?;
        let mut copies = Vec::with_capacity(sections.len());
        for (section, (offsets, start, end)) in sections.iter().zip(laid) {
            let k = section.pages.len();
            let space = self.section_space(offsets, start, end, k as u64)?;
            let copy = BlockCopyPlan::new(
                space.as_ref(),
                PageSelection::Positions,
                dst.as_ref(),
                PageSelection::Local(section.pages.clone()),
                k,
            )?
            .only_components(space.as_ref(), &section.components);
            copies.push((copy, space));
        }
        let dst_space: Arc<dyn BlockSpace> = dst.clone();
        for (copy, space) in copies {
            let src_space: Arc<dyn BlockSpace> = space;
            self.store
                .launch(&copy, &src_space, &dst_space, self.launch)?;
        }
        self.store.backend().record()
    }

    /// The backend the copies run on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        self.store.backend()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::geometry::{LatentLayout, PoolGeometry};

    #[test]
    fn sections_are_contiguous_and_hold_only_their_components() {
        let g = CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
            LatentLayout::Fp8Trtllm,
            vec![true, false, true],
        ));
        let all = g.components();
        let latent: Vec<Component> = all
            .iter()
            .map(|c| c.component)
            .filter(|c| matches!(c, Component::TargetLatent | Component::DraftLatent))
            .collect();
        let laid = layout(&all, &[(latent.clone(), 3)]).unwrap();
        let (offsets, start, end) = &laid[0];
        assert_eq!(*start, 0);
        let want: usize = latent
            .iter()
            .map(|&c| {
                let l = all.iter().find(|l| l.component == c).unwrap();
                (3 * l.page_bytes()).next_multiple_of(REGION_ALIGN)
            })
            .sum();
        assert_eq!(*end, want, "only the section's components take room");
        assert!(offsets.iter().all(|&o| o < *end));
        let b = BounceBuffer::new(Arc::new(CpuBackend::new()), &g, 4).unwrap();
        assert!(b.buffer().len() >= *end);
        assert!(BounceBuffer::new(Arc::new(CpuBackend::new()), &g, 0).is_err());
    }
}
