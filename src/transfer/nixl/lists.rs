//! The index math of the descriptor lists a prefill rank prepares once per connection: its
//! pool's (page, layer) blocks followed by every prefix of every bounce slot, the same layout
//! on the decode side, so a chunk is a transfer request of indices into the two (module docs
//! of [`super`], "Descriptor lists").

use crate::error::{Checked, Error, Result};
use crate::geometry::ComponentLayout;

/// Index math of one side's prepared list: the pool's blocks (`[component][layer][page]`),
/// then every prefix of every bounce slot (`[slot][component][pages - 1]`).
#[derive(Debug, Clone)]
pub(super) struct ListLayout {
    pages: u64,
    component_offsets: Vec<u64>,
    pool_blocks: u64,
    components: u64,
    pub(super) slot_pages: u64,
    slots: u64,
}

impl ListLayout {
    pub(super) fn new(
        components: &[ComponentLayout],
        pages: u64,
        slot_pages: u64,
        slots: u64,
    ) -> Result<Self> {
        let what = || format!("descriptors of a {pages}-page pool");
        let mut offsets = Vec::with_capacity(components.len());
        let mut blocks = 0u64;
        for c in components {
            offsets.push(blocks);
            blocks = (c.layers() as u64)
                .mul_or(pages, what)?
                .add_or(blocks, what)?;
        }
        let layout = Self {
            pages,
            component_offsets: offsets,
            pool_blocks: blocks,
            components: components.len() as u64,
            slot_pages,
            slots,
        };
        // Every index must fit the i32 NIXL takes.
        let len = layout.len()?;
        if len > i32::MAX as u64 {
            return Err(Error::overflow(format!(
                "{len} prepared descriptors (NIXL indexes lists with i32)"
            )));
        }
        Ok(layout)
    }

    fn len(&self) -> Result<u64> {
        let what = || "prepared descriptors".to_string();
        self.slots
            .mul_or(self.components, what)?
            .mul_or(self.slot_pages, what)?
            .add_or(self.pool_blocks, what)
    }

    /// Block (component index `c`, stored layer, page).
    pub(super) fn block(&self, c: usize, layer: usize, page: u64) -> i32 {
        // In range: the layout was checked to fit i32, and callers pass pages and layers the
        // plan checked against the spaces.
        (self.component_offsets[c] + layer as u64 * self.pages + page) as i32
    }

    /// The first `k` (>= 1) pages of component index `c` of slot `slot`.
    pub(super) fn prefix(&self, slot: usize, c: usize, k: u64) -> i32 {
        (self.pool_blocks + (slot as u64 * self.components + c as u64) * self.slot_pages + k - 1)
            as i32
    }

    /// The (address, bytes) of every entry, in index order: `layer_base(c, l)` of the pool and
    /// `slot_base(s, c)` of each slot component.
    pub(super) fn descriptors(
        &self,
        components: &[ComponentLayout],
        layer_base: impl Fn(usize, usize) -> u64,
        slot_base: impl Fn(usize, usize) -> u64,
    ) -> Vec<(u64, u64)> {
        let mut out = Vec::with_capacity(self.len().unwrap_or(0) as usize);
        for (c, comp) in components.iter().enumerate() {
            let block = comp.block_bytes as u64;
            for l in 0..comp.layers() {
                let base = layer_base(c, l);
                out.extend((0..self.pages).map(|p| (base + p * block, block)));
            }
        }
        for s in 0..self.slots as usize {
            for (c, comp) in components.iter().enumerate() {
                let base = slot_base(s, c);
                let page = comp.page_bytes() as u64;
                out.extend((1..=self.slot_pages).map(|k| (base, k * page)));
            }
        }
        out
    }
}
