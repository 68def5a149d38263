//! The host pool's layout math: SGLang's three layouts, how a format arranges components in
//! buffers (a packed draft or separate buffers), and the strides that follow.

use crate::error::{Checked, Error, Result};
use crate::geometry::{CacheGeometry, Component, ComponentLayout};

use super::*;

/// How a host pool orders the blocks of one buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostLayout {
    /// `[L][pages][block]`: the device pool's order; one layer's pages are contiguous.
    LayerFirst,
    /// `[pages * 64 tokens][L][row]` (indexer: `[pages][L][8448]`): token-major, SGLang's
    /// default and what its storage backends read. One page of all layers is one contiguous run,
    /// but one layer's rows inside it are `L * row` bytes apart.
    PageFirst,
    /// `[pages][L][block]`: page-granular; one page of all layers is one contiguous run and every
    /// (page, layer) block is contiguous.
    PageFirstDirect,
}

impl HostLayout {
    /// Every layout, for tests and benchmarks that cover each.
    pub const ALL: [HostLayout; 3] = [Self::LayerFirst, Self::PageFirst, Self::PageFirstDirect];

    /// Where the blocks of `component` sit in a buffer of `pages` pages holding that component
    /// alone, in this layout (pools that hold their bytes never overflow these; see
    /// [`HostPool`]).
    pub fn strides(self, component: &ComponentLayout, pages: u64) -> LayoutStrides {
        self.buffer_strides(
            component.layers(),
            pages,
            component.block_bytes,
            component.rows,
            component.row_bytes,
        )
    }

    /// Strides of a buffer of `layers` stored layers and `pages` pages of `block`-byte blocks
    /// made of `rows` rows of `row` bytes (saturating on sizes no pool can hold).
    pub fn buffer_strides(
        self,
        layers: usize,
        pages: u64,
        block: usize,
        rows: usize,
        row: usize,
    ) -> LayoutStrides {
        let layers = layers as u64;
        let (block, row) = (block as u64, row as u64);
        let token_major = self == Self::PageFirst && rows > 1;
        match self {
            Self::LayerFirst => LayoutStrides {
                layer_stride: pages.saturating_mul(block),
                page_stride: block,
                row_stride: row,
            },
            _ if token_major => LayoutStrides {
                layer_stride: row,
                page_stride: layers.saturating_mul(block),
                row_stride: layers.saturating_mul(row),
            },
            _ => LayoutStrides {
                layer_stride: block,
                page_stride: layers.saturating_mul(block),
                row_stride: row,
            },
        }
    }

    /// The contiguous unit of one page of `component` that registration chunks must not split:
    /// one block for [`HostLayout::LayerFirst`], one page of every layer otherwise.
    pub fn page_unit(self, component: &ComponentLayout) -> usize {
        self.buffer_page_unit(component.layers(), component.block_bytes)
    }

    /// As [`HostLayout::page_unit`], for a buffer of `layers` layers of `block`-byte blocks.
    pub fn buffer_page_unit(self, layers: usize, block: usize) -> usize {
        match self {
            Self::LayerFirst => block,
            Self::PageFirst | Self::PageFirstDirect => layers.saturating_mul(block),
        }
    }

    /// The layout SGLang names `name` (`layer_first`, `page_first`, `page_first_direct`).
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "layer_first" => Ok(Self::LayerFirst),
            "page_first" => Ok(Self::PageFirst),
            "page_first_direct" => Ok(Self::PageFirstDirect),
            other => Err(Error::InvalidArgument(format!(
                "host layout {other:?} (kvshard has layer_first, page_first and page_first_direct)"
            ))),
        }
    }
}

impl std::fmt::Display for HostLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::LayerFirst => "layer_first",
            Self::PageFirst => "page_first",
            Self::PageFirstDirect => "page_first_direct",
        })
    }
}

/// Where a host pool keeps the MTP draft's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DraftPacking {
    /// Buffers of their own (kvshard's layout; SGLang's "sidecar" draft, a host pool of its own).
    #[default]
    Separate,
    /// The tail layer of the target's buffers (SGLang's default for NextN drafts: `L = target
    /// layers + 1`, loaded with `is_draft=True`).
    Packed,
}

/// How a host pool arranges its buffers: the layout, where the draft goes, and the extra pages
/// of indexer buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostFormat {
    /// Block order of every buffer.
    pub layout: HostLayout,
    /// Where the draft's rows are.
    pub draft: DraftPacking,
    /// Pages indexer buffers hold beyond the pool's pages (never used by transfers; SGLang's
    /// indexer host pool has one).
    pub indexer_extra_pages: u64,
}

impl HostFormat {
    /// kvshard's own format: one buffer per component, no extra pages.
    pub const fn kvshard(layout: HostLayout) -> Self {
        Self {
            layout,
            draft: DraftPacking::Separate,
            indexer_extra_pages: 0,
        }
    }

    /// SGLang's host pools (sglang 0.5.x): the indexer buffer one page longer, the draft packed
    /// into the target's buffers or (`packed_draft = false`) in buffers of its own.
    pub const fn sglang(layout: HostLayout, packed_draft: bool) -> Self {
        Self {
            layout,
            draft: if packed_draft {
                DraftPacking::Packed
            } else {
                DraftPacking::Separate
            },
            indexer_extra_pages: 1,
        }
    }

    /// The buffers a pool of `pages` pages of `geometry` has in this format, in order: the
    /// order regions are handed to [`HostPool::register_with`], [`HostPool::adopt_registered`]
    /// and [`HostPool::wrap`].
    pub fn buffers(&self, geometry: &CacheGeometry, pages: u64) -> Result<Vec<HostBufferLayout>> {
        let components = HostPool::check(geometry, pages)?;
        Ok(self.plan(&components, pages)?.0)
    }

    /// The buffers, and per component its (buffer, first stored layer in the buffer).
    pub(super) fn plan(&self, components: &[ComponentLayout], pages: u64) -> Result<BufferPlan> {
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for (c, comp) in components.iter().enumerate() {
            let packed_into = match (self.draft, comp.component) {
                (DraftPacking::Packed, Component::DraftLatent) => Some(Component::TargetLatent),
                (DraftPacking::Packed, Component::DraftIndexer) => Some(Component::TargetIndexer),
                _ => None,
            };
            let host = packed_into.and_then(|target| {
                groups
                    .iter()
                    .position(|g| components[g[0]].component == target)
            });
            match host {
                Some(g) => groups[g].push(c),
                None => groups.push(vec![c]),
            }
        }
        let mut slots = vec![(0, 0); components.len()];
        let mut buffers = Vec::with_capacity(groups.len());
        for (b, group) in groups.iter().enumerate() {
            let first = &components[group[0]];
            let mut layers = 0usize;
            for &c in group {
                let comp = &components[c];
                if (comp.block_bytes, comp.rows, comp.row_bytes)
                    != (first.block_bytes, first.rows, first.row_bytes)
                {
                    return Err(Error::GeometryMismatch {
                        what: format!("{} packed with {}", comp.component, first.component),
                        expected: format!("{} B blocks", first.block_bytes),
                        got: format!("{} B blocks", comp.block_bytes),
                    });
                }
                slots[c] = (b, layers);
                layers += comp.layers();
            }
            let buffer_pages = if first.component.is_indexer() {
                pages.add_or(self.indexer_extra_pages, || {
                    format!("{pages} + {} indexer pages", self.indexer_extra_pages)
                })?
            } else {
                pages
            };
            let what = || format!("bytes of {buffer_pages} host pages of {}", first.component);
            let bytes = layers
                .mul_or(first.block_bytes, what)?
                .mul_or(crate::error::to_usize(buffer_pages, what)?, what)?;
            // Every stride must fit too (a page-major page stride is layers x block).
            u64::try_from(bytes).map_err(|_| Error::overflow(what()))?;
            buffers.push(HostBufferLayout {
                components: group.iter().map(|&c| components[c].component).collect(),
                layers,
                pages: buffer_pages,
                block_bytes: first.block_bytes,
                rows: first.rows,
                row_bytes: first.row_bytes,
                bytes,
                strides: self.layout.buffer_strides(
                    layers,
                    buffer_pages,
                    first.block_bytes,
                    first.rows,
                    first.row_bytes,
                ),
            });
        }
        Ok((buffers, slots))
    }
}

/// A format's buffers, and per component its (buffer, first stored layer in the buffer).
pub(super) type BufferPlan = (Vec<HostBufferLayout>, Vec<(usize, usize)>);

impl From<HostLayout> for HostFormat {
    fn from(layout: HostLayout) -> Self {
        Self::kvshard(layout)
    }
}

impl std::fmt::Display for HostFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.layout)?;
        if self.draft == DraftPacking::Packed {
            f.write_str(", packed draft")?;
        }
        if self.indexer_extra_pages > 0 {
            write!(f, ", {} extra indexer pages", self.indexer_extra_pages)?;
        }
        Ok(())
    }
}

/// One host buffer of a pool: which components it holds, its size and strides.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostBufferLayout {
    /// Components stored in it, in layer order (the target's, then a packed draft's).
    pub components: Vec<Component>,
    /// Stored layers of all its components.
    pub layers: usize,
    /// Pages it holds.
    pub pages: u64,
    /// Bytes of one (page, layer) block.
    pub block_bytes: usize,
    /// Rows of a block (64 latent rows, or 1 for a page-major indexer block).
    pub rows: usize,
    /// Bytes of one row.
    pub row_bytes: usize,
    /// Bytes of the whole buffer: `pages * layers * block_bytes`.
    pub bytes: usize,
    /// Its strides.
    pub strides: LayoutStrides,
}

impl HostBufferLayout {
    /// Whether this buffer holds indexer blocks.
    pub fn is_indexer(&self) -> bool {
        self.components.first().is_some_and(|c| c.is_indexer())
    }

    /// Byte offset (from the buffer's start) of row `row` of block (`layer`, `page`), where
    /// `layer` counts every layer of the buffer (a packed draft's is the last), or `None`
    /// outside the buffer.
    pub fn offset(&self, layer: usize, page: u64, row: usize) -> Option<u64> {
        if layer >= self.layers || page >= self.pages || row >= self.rows {
            return None;
        }
        let s = self.strides;
        Some(layer as u64 * s.layer_stride + page * s.page_stride + row as u64 * s.row_stride)
    }
}

/// Byte distances inside one buffer of a host pool (see the module table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayoutStrides {
    /// Between (layer `l`, page 0) and (layer `l + 1`, page 0).
    pub layer_stride: u64,
    /// Between consecutive pages of one layer.
    pub page_stride: u64,
    /// Between consecutive rows of one block.
    pub row_stride: u64,
}
