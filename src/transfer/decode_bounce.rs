//! The bounce route into a decode server sharded by token (docs/dcp.md, "Over NIXL and
//! Mooncake"): across hosts the decode ranks' pools are not mapped, so a prefill rank packs each
//! decode rank's rows of a chunk densely into a region of its own bounce memory with one
//! `kvs_decode_scatter` launch ([`DenseBounce::pack`]), the transfer engine moves each region
//! as one range (one descriptor per chunk, prefill rank and decode rank), and each decode rank
//! moves its rows out of its copy of the region into its pages with the same kernel
//! ([`DenseBounce::unpack`]).
//!
//! **What travels.** A decode rank learns the region's layout from a [`DenseChunk`] riding on
//! the chunk's status: the end of the tokens moved and, per section (the latent KV of the
//! chunk's pages; the final chunk's indexer state), its components and the sequence pages whose
//! rows of the rank it carries, in order. Both sides compute the region from that alone: the
//! rank's rows of each section, page after page ([`DecodeLayout::dense_rows`]), are the rows of
//! the section's components, `[section][component][layer][row]` ([`region_layout`]): a latent
//! layer holds exactly its rows; an indexer layer fills 64-row pages (keys, then scales, as in a
//! pool), so its last page may carry up to 63 rows of padding; each component's part is rounded
//! up to 256 bytes.
//!
//! **Bounds.** The region must fit the bounce slot it goes through (a chunk whose region for some
//! decode rank does not is refused before anything moves, with the bytes it needs); a decode
//! rank checks everything a [`DenseChunk`] says against its registration and its slot before it
//! enqueues the unpack (the kernel re-checks every index it reads).

use std::fmt;
use std::sync::Arc;

use crate::abi;
use crate::backend::{AddressSpace, Backend, Buffer, Event, KernelFamily, Launch};
use crate::copy::space::{sealed, REGION_ALIGN};
use crate::copy::{
    BlockSpace, DecodeScatterPlan, ScatterRank, ScatterSection, SpaceId, TableStore,
};
use crate::error::{Checked, Error, Result};
use crate::geometry::{Component, ComponentLayout, PAGE_SIZE};
use crate::index::LocalPage;
use crate::pool::DevicePool;
use crate::shard::DecodeLayout;

use super::plan::{DecodePlan, DecodeSection};

/// One section of a chunk bounced to a decode rank: its components, and the sequence pages
/// whose rows of the rank it carries, in the order they were packed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenseSection {
    /// Components of the section, in send order.
    pub components: Vec<Component>,
    /// Sequence pages, in packing order.
    pub positions: Vec<u64>,
}

/// What one decode rank needs to unpack a chunk bounced to it (module docs): sent with the
/// chunk's status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenseChunk {
    /// Rows of tokens at or past this were not moved.
    pub end_token: u64,
    /// The sections, in the region's order (none for a rank the chunk moves nothing to).
    pub sections: Vec<DenseSection>,
}

impl DenseChunk {
    /// Decode rank `rank`'s part of `plan`: the sections moving rows to it, each with the
    /// sequence pages that hold some of its rows.
    pub fn of_plan(plan: &DecodePlan, rank: u32) -> Self {
        let layout = plan.layout();
        let end = plan.end_token();
        let sections = [plan.kv(), plan.state()]
            .into_iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s: &DecodeSection| {
                let positions: Vec<u64> = s
                    .entries()
                    .iter()
                    .map(|&(_, p)| p)
                    .filter(|&p| layout.page_rows(rank, p, end).1 > 0)
                    .collect();
                (!positions.is_empty()).then(|| DenseSection {
                    components: s.components().iter().map(|c| c.component).collect(),
                    positions,
                })
            })
            .collect();
        Self {
            end_token: end,
            sections,
        }
    }

    /// Whether the chunk moves nothing to the rank.
    pub fn is_empty(&self) -> bool {
        self.sections.is_empty()
    }

    /// Rows of each section on decode rank `rank` of `layout`.
    pub fn section_rows(&self, layout: DecodeLayout, rank: u32) -> Vec<u64> {
        self.sections
            .iter()
            .map(|s| layout.dense_rows(rank, self.end_token, &s.positions).rows)
            .collect()
    }

    /// Bytes of the rank's region in a cache of `components` (module docs).
    pub fn region_bytes(
        &self,
        components: &[ComponentLayout],
        layout: DecodeLayout,
        rank: u32,
    ) -> Result<u64> {
        Ok(region_layout(components, &self.shape(layout, rank))?.1 as u64)
    }

    /// (components, rows) of each section on `rank`.
    fn shape(&self, layout: DecodeLayout, rank: u32) -> Vec<(Vec<Component>, u64)> {
        self.sections
            .iter()
            .zip(self.section_rows(layout, rank))
            .map(|(s, rows)| (s.components.clone(), rows))
            .collect()
    }

    /// The sections as the scatter moves them (an unpack reads no source page): the latent
    /// one through the rank's pages, the indexer state through its state pages.
    fn scatter_sections(&self) -> Result<[ScatterSection; 2]> {
        let mut out = [ScatterSection::default(), ScatterSection::default()];
        for s in &self.sections {
            let state = s.components.iter().any(|c| c.is_indexer());
            let slot = &mut out[usize::from(state)];
            if !slot.components.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "a bounced chunk with two {} sections",
                    if state { "indexer state" } else { "latent" }
                )));
            }
            *slot = ScatterSection {
                components: s.components.clone(),
                entries: s.positions.iter().map(|&p| (LocalPage(0), p)).collect(),
            };
        }
        Ok(out)
    }
}

/// Where one component lies in a bounce region.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegionPart {
    /// Bytes from the region's start to its layer 0.
    pub offset: usize,
    /// Bytes from one of its layers to the next.
    pub layer_stride: usize,
    /// Pages of 64 rows a layer's rows reach into.
    pub pages: u64,
}

/// Where each component of a region lies: per component index of `components` its part (all
/// zero for one no section moves), and the region's bytes. `sections` are (components, rows) in the region's order; a component in two
/// sections is refused. A latent layer's rows follow each other (the region holds exactly the
/// rows); an indexer layer takes whole 64-row pages (its keys, then its scales, as in a pool).
pub fn region_layout(
    components: &[ComponentLayout],
    sections: &[(Vec<Component>, u64)],
) -> Result<(Vec<RegionPart>, usize)> {
    let mut at = 0usize;
    let mut out = vec![RegionPart::default(); components.len()];
    let mut seen = vec![false; components.len()];
    for (section, rows) in sections {
        let what = || format!("a bounce region of {rows} rows");
        let pages = rows.div_ceil(PAGE_SIZE as u64);
        for &component in section {
            let c = components
                .iter()
                .position(|l| l.component == component)
                .ok_or_else(|| Error::InvalidArgument(format!("the cache holds no {component}")))?;
            if std::mem::replace(&mut seen[c], true) {
                return Err(Error::InvalidArgument(format!(
                    "a bounce region holds {component} twice"
                )));
            }
            let comp = &components[c];
            // Row bytes are multiples of 16: every layer starts where a vector may.
            let stride = if component.is_indexer() {
                crate::error::to_usize(pages, what)?.mul_or(comp.block_bytes, what)?
            } else {
                crate::error::to_usize(*rows, what)?.mul_or(comp.row_bytes, what)?
            };
            out[c] = RegionPart {
                offset: at,
                layer_stride: stride,
                pages,
            };
            at = stride
                .mul_or(comp.layers(), what)?
                .add_or(at, what)?
                .checked_next_multiple_of(REGION_ALIGN)
                .ok_or_else(|| Error::overflow(what()))?;
        }
    }
    Ok((out, at))
}

/// One decode rank's region of a chunk as a block space: every component of the cache (so the
/// scatter can pair it with a pool), each holding its section's rows ([`region_layout`]), or
/// none (never addressed: no pair of the scatter names it); `pages` is the largest section's.
/// Pages are one block apart inside a layer, as the scatter addresses them; a latent layer's
/// last page may run into the next layer's rows, which no row of it reaches (the scatter writes
/// and reads rows below the section's rows only).
struct DenseSpace {
    id: SpaceId,
    space: AddressSpace,
    components: Vec<ComponentLayout>,
    pages: u64,
    /// Where each component lies in `buffer`.
    parts: Vec<RegionPart>,
    buffer: Buffer,
}

impl fmt::Debug for DenseSpace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DenseSpace")
            .field("id", &self.id)
            .field("pages", &self.pages)
            .field("bytes", &self.buffer.len())
            .finish_non_exhaustive()
    }
}

impl sealed::Sealed for DenseSpace {
    fn base(&self, c: usize, layer: usize) -> u64 {
        let part = self.parts[c];
        self.buffer.addr() + (part.offset + layer * part.layer_stride) as u64
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

crate::copy::space::block_space!(DenseSpace);

impl DenseSpace {
    /// The region of `sections` ((components, rows) each) at the start of `memory` (a bounce
    /// slot), which must hold it.
    fn new(
        memory: &Buffer,
        components: &[ComponentLayout],
        sections: &[(Vec<Component>, u64)],
    ) -> Result<Arc<Self>> {
        let (parts, bytes) = region_layout(components, sections)?;
        if bytes > memory.len() {
            return Err(Error::InvalidArgument(format!(
                "a bounce region of {bytes} B does not fit a slot of {} B",
                memory.len()
            )));
        }
        Ok(Arc::new(Self {
            id: SpaceId::next(),
            space: memory.space(),
            components: components.to_vec(),
            pages: parts.iter().map(|p| p.pages).max().unwrap_or(0),
            parts,
            buffer: memory.slice(0, bytes)?,
        }))
    }
}

/// A chunk packed for every decode rank it moves rows to.
#[derive(Debug)]
pub struct DensePacked {
    /// Per decode rank, in rank order: what it needs to unpack (empty for a rank the chunk
    /// moves nothing to), and the bytes of its region (0 there).
    pub ranks: Vec<(DenseChunk, u64)>,
    /// Recorded after the packing: the engine may read the regions once it has passed.
    pub event: Event,
}

/// Bytes of decode rank `rank`'s region of `plan` in a cache of `components`, and what it
/// needs to unpack it.
pub fn region_of(
    plan: &DecodePlan,
    components: &[ComponentLayout],
    rank: u32,
) -> Result<(DenseChunk, u64)> {
    let chunk = DenseChunk::of_plan(plan, rank);
    let bytes = chunk.region_bytes(components, plan.layout(), rank)?;
    Ok((chunk, bytes))
}

/// The packing and unpacking of the bounce route on one backend's stream (module docs): a
/// prefill rank packs its chunks with one, a decode rank unpacks them with another. The regions
/// are the caller's bounce memory (registered with its transfer engine once).
pub struct DenseBounce {
    store: TableStore,
    launch: Launch,
}

impl fmt::Debug for DenseBounce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DenseBounce")
            .field("launch", &self.launch)
            .finish_non_exhaustive()
    }
}

impl DenseBounce {
    /// Launches on `backend`'s stream (the source's device when packing, the destination's when
    /// unpacking), as a block copy's grid.
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        let launch = Launch {
            ctas: 264,
            threads: backend.max_threads(KernelFamily::DecodeScatter).min(512),
        };
        Self {
            store: TableStore::new(backend),
            launch,
        }
    }

    /// The backend the launches run on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        self.store.backend()
    }

    /// Enqueues one `kvs_decode_scatter` launch packing every decode rank's rows of `plan` from
    /// `src` (this prefill rank's pool) into `regions[d]` (one bounce slot per decode rank the
    /// chunk moves rows to; `None` for the others), each region from its start. Refused, before
    /// anything moves, when a region does not fit its slot or a rank the chunk moves rows to
    /// has none. The caller must not pack into a slot again before the engine has moved it.
    pub fn pack(
        &mut self,
        plan: &DecodePlan,
        src: &Arc<DevicePool>,
        regions: &[Option<Buffer>],
    ) -> Result<DensePacked> {
        let m = plan.layout().ranks() as usize;
        if regions.len() != m {
            return Err(Error::InvalidArgument(format!(
                "{} bounce regions for {m} decode ranks",
                regions.len()
            )));
        }
        let components = src.geometry().components();
        let mut ranks = Vec::with_capacity(m);
        let mut spaces: Vec<Arc<dyn BlockSpace>> = Vec::with_capacity(m);
        // A rank the chunk moves nothing to gets an empty region of any slot: nothing lands
        // there.
        let any = regions.iter().flatten().next();
        for (d, region) in (0u32..).zip(regions) {
            let (chunk, bytes) = region_of(plan, &components, d)?;
            let memory = match (region, any) {
                (Some(memory), _) => memory,
                (None, Some(memory)) if chunk.is_empty() => memory,
                _ if chunk.is_empty() => {
                    // No rank has rows of the chunk: nothing to pack.
                    ranks.push((chunk, bytes));
                    continue;
                }
                _ => {
                    return Err(Error::Transfer {
                        request: plan.request(),
                        reason: format!("decode rank {d} has rows of the chunk but no bounce slot"),
                    })
                }
            };
            spaces.push(DenseSpace::new(
                memory,
                &components,
                &packed_shape(plan, d),
            )?);
            ranks.push((chunk, bytes));
        }
        if spaces.len() == m {
            let refs: Vec<&dyn BlockSpace> = spaces.iter().map(|s| s.as_ref()).collect();
            let scatter = plan.pack(src.as_ref(), &refs)?;
            let src_space: Arc<dyn BlockSpace> = src.clone();
            self.store
                .launch_scatter(&scatter, &src_space, &spaces, self.launch)?;
        }
        Ok(DensePacked {
            ranks,
            event: self.store.backend().record()?,
        })
    }

    /// Enqueues one `kvs_decode_scatter` launch moving decode rank `rank`'s rows of a chunk
    /// bounced to it (`chunk` says how) out of `region` (the slot they landed in) into `dst`
    /// (its pool), `pages` its pages of the request; returns the event after which they are
    /// there. Everything `chunk` says is checked against the slot, the layout and the pages
    /// before anything is enqueued.
    pub fn unpack(
        &mut self,
        chunk: &DenseChunk,
        layout: DecodeLayout,
        rank: u32,
        region: &Buffer,
        dst: &Arc<DevicePool>,
        pages: &ScatterRank,
    ) -> Result<Event> {
        let components = dst.geometry().components();
        let space = DenseSpace::new(region, &components, &chunk.shape(layout, rank))?;
        let [kv, state] = chunk.scatter_sections()?;
        let plan = DecodeScatterPlan::unpack(
            space.as_ref(),
            dst.as_ref(),
            layout,
            rank,
            chunk.end_token,
            kv,
            state,
            pages,
        )?;
        let src: Arc<dyn BlockSpace> = space;
        let dst: Arc<dyn BlockSpace> = dst.clone();
        self.store
            .launch_scatter(&plan, &src, &[dst], self.launch)?;
        self.store.backend().record()
    }
}

/// Decode rank `rank`'s region of `plan` as the packing lays it out: both sections of the plan
/// (the scatter pairs every region with the same pairs), each holding the rank's rows (none
/// where it has none).
fn packed_shape(plan: &DecodePlan, rank: u32) -> Vec<(Vec<Component>, u64)> {
    [plan.kv(), plan.state()]
        .into_iter()
        .filter(|s| !s.is_empty())
        .map(|s| {
            let positions: Vec<u64> = s.entries().iter().map(|&(_, p)| p).collect();
            let rows = plan
                .layout()
                .dense_rows(rank, plan.end_token(), &positions)
                .rows;
            (s.components().iter().map(|c| c.component).collect(), rows)
        })
        .collect()
}
