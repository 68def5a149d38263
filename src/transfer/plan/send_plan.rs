//! [`SendPlan`]: one chunk's plan as plain data (its [`Section`]s of coalesced runs, expanded
//! layer by layer into [`Descriptor`]s) and what it answers.

use std::fmt;
use std::ops::Range;

use super::ChunkRange;
use crate::copy::{BlockSpace, OwnedRuns, Run};
use crate::error::{Error, Result};
use crate::geometry::Component;
use crate::shard::Placement;
use crate::transfer::ComponentBytes;

/// One component a section moves, with the layers its runs apply to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectionComponent {
    /// Which component.
    pub component: Component,
    /// Stored layers of the component (every one moves the section's runs).
    pub layers: usize,
    /// Bytes of one (page, layer) block: the unit of descriptor offsets and lengths.
    pub item: u64,
}

/// One part of a plan: the latent KV of the chunk's positions, or the indexer state of the
/// whole sequence. Its runs apply to every layer of every component it lists.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Section {
    pub(super) positions: Range<usize>,
    pub(super) components: Vec<SectionComponent>,
    pub(super) owned: OwnedRuns,
}

impl Section {
    /// Page positions of the sequence the section covers (all ranks' positions).
    pub fn positions(&self) -> Range<usize> {
        self.positions.clone()
    }

    /// Components moved, in send order.
    pub fn components(&self) -> &[SectionComponent] {
        &self.components
    }

    /// This rank's pages of the section: (local source page, destination page) pairs, in
    /// position order, and their coalesced runs.
    pub fn owned(&self) -> &OwnedRuns {
        &self.owned
    }

    /// Coalesced runs of this rank's pages, in position order.
    pub fn runs(&self) -> &[Run] {
        self.owned.runs()
    }

    /// Positions of the section this rank owns.
    pub fn owned_pages(&self) -> usize {
        self.owned.len()
    }

    /// Layers of all components of the section.
    pub fn layers(&self) -> usize {
        self.components.iter().map(|c| c.layers).sum()
    }

    /// Descriptors the section expands to: one per run and layer.
    pub fn descriptor_count(&self) -> usize {
        self.runs().len() * self.layers()
    }

    /// Descriptors without coalescing: one per owned page and layer.
    pub fn uncoalesced_count(&self) -> usize {
        self.owned_pages() * self.layers()
    }

    /// Bytes the section moves, per component.
    pub fn bytes(&self) -> ComponentBytes {
        let mut out = ComponentBytes::default();
        for c in &self.components {
            out.add(
                c.component,
                self.owned_pages() as u64 * c.layers as u64 * c.item,
            );
        }
        out
    }

    /// Whether this rank moves nothing in the section.
    pub fn is_empty(&self) -> bool {
        self.owned.is_empty() || self.components.is_empty()
    }
}

/// One descriptor: `bytes` bytes from `src_offset` of the source's (component, layer) buffer
/// to `dst_offset` of the destination's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    /// Component of both buffers.
    pub component: Component,
    /// Stored layer of the component.
    pub layer: usize,
    /// Offset from the source layer's base.
    pub src_offset: u64,
    /// Offset from the destination layer's base.
    pub dst_offset: u64,
    /// Length.
    pub bytes: u64,
}

/// Everything one prefill rank sends for one chunk of one request: plain data, immutable once
/// built (every page was checked when it was).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendPlan {
    pub(super) request: u64,
    pub(super) placement: Placement,
    pub(super) rank: u32,
    pub(super) chunk: ChunkRange,
    pub(super) kv: Section,
    pub(super) state: Section,
}

impl SendPlan {
    /// Request id.
    pub fn request(&self) -> u64 {
        self.request
    }

    /// Sharding of the prefill group.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The sending rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The chunk as asked for.
    pub fn chunk(&self) -> ChunkRange {
        self.chunk
    }

    /// Latent KV of the chunk's whole pages (all of them with the final chunk).
    pub fn kv(&self) -> &Section {
        &self.kv
    }

    /// Indexer state of the whole sequence: final chunk only, empty otherwise.
    pub fn state(&self) -> &Section {
        &self.state
    }

    /// The sections in send order: latent KV, then indexer state.
    pub fn sections(&self) -> [&Section; 2] {
        [&self.kv, &self.state]
    }

    /// Every descriptor in send order: per section, per component, per layer, per run.
    pub fn descriptors(&self) -> impl Iterator<Item = Descriptor> + '_ {
        self.sections().into_iter().flat_map(|section| {
            section.components.iter().flat_map(move |&c| {
                (0..c.layers).flat_map(move |layer| {
                    section.runs().iter().map(move |run| Descriptor {
                        component: c.component,
                        layer,
                        src_offset: run.src.0 * c.item,
                        dst_offset: run.dst.0 * c.item,
                        bytes: run.pages * c.item,
                    })
                })
            })
        })
    }

    /// Descriptors after coalescing.
    pub fn descriptor_count(&self) -> usize {
        self.kv.descriptor_count() + self.state.descriptor_count()
    }

    /// Descriptors before coalescing: one per owned page and layer.
    pub fn uncoalesced_count(&self) -> usize {
        self.kv.uncoalesced_count() + self.state.uncoalesced_count()
    }

    /// Bytes this rank moves for the chunk, per component.
    pub fn bytes(&self) -> ComponentBytes {
        let mut out = self.kv.bytes();
        out += self.state.bytes();
        out
    }

    /// Whether this rank moves nothing for the chunk (it still reports the chunk).
    pub fn is_empty(&self) -> bool {
        self.descriptor_count() == 0
    }

    /// Checks `src` (this rank's pool) and `dst` (the decode side) hold what this plan moves:
    /// the components and layers of every section, packed, with at least the pages its runs
    /// address. A plan is checked against the layouts it was built from; this ties it to the
    /// actual spaces before any byte moves.
    pub fn check_spaces(&self, src: &dyn BlockSpace, dst: &dyn BlockSpace) -> Result<()> {
        let fail = |reason: String| {
            Err(Error::Transfer {
                request: self.request,
                reason,
            })
        };
        for section in self.sections() {
            let Some((src_end, dst_end)) = section.owned.page_ends() else {
                continue;
            };
            for c in &section.components {
                for (side, space, end) in [("source", src, src_end), ("destination", dst, dst_end)]
                {
                    let Some(layout) = space
                        .components()
                        .iter()
                        .find(|l| l.component == c.component)
                    else {
                        return fail(format!("the {side} holds no {}", c.component));
                    };
                    if layout.layers() != c.layers {
                        return fail(format!(
                            "the {side} holds {} {} layers, the plan moves {}",
                            layout.layers(),
                            c.component,
                            c.layers
                        ));
                    }
                    if layout.block_bytes as u64 != c.item {
                        return fail(format!(
                            "the {side} stores {} B {} blocks, the plan moves {} B blocks",
                            layout.block_bytes, c.component, c.item
                        ));
                    }
                    if space.pages() < end {
                        return fail(format!(
                            "the plan moves {} pages up to page {}, the {side} holds {} pages per layer",
                            c.component,
                            end - 1,
                            space.pages()
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

impl fmt::Display for SendPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.chunk;
        write!(
            f,
            "request {} rank {}/{} chunk {} tokens [{}, {}){}",
            self.request,
            self.rank,
            self.placement.shard(),
            c.index,
            c.start,
            c.end,
            if c.last { " final" } else { "" }
        )?;
        for (name, s) in [("kv", &self.kv), ("state", &self.state)] {
            if s.components.is_empty() {
                continue;
            }
            write!(
                f,
                "; {name} pages {}..{}: {} owned in {} runs x {} layers",
                s.positions.start,
                s.positions.end,
                s.owned_pages(),
                s.runs().len(),
                s.layers()
            )?;
        }
        write!(
            f,
            "; {} descriptors ({} before coalescing), {}",
            self.descriptor_count(),
            self.uncoalesced_count(),
            self.bytes()
        )
    }
}
