//! The index math of the descriptor lists a prefill rank prepares once per connection: its
//! pool's (page, layer) blocks, every prefix of every bounce slot's components, then every
//! prefix of every whole slot in granules (a decode context-parallel chunk's dense region is
//! one range from a slot's start, docs/dcp.md), the same layout on the decode side, so a chunk
//! is a transfer request of indices into the two (module docs of [`super`], "Descriptor
//! lists").

use crate::copy::space::REGION_ALIGN;
use crate::error::{Checked, Error, Result};
use crate::geometry::ComponentLayout;

/// Most whole-slot prefixes a slot gets in the prepared lists: a dense region is rounded up to
/// the next of them, so at most 1/1024 of a slot travels past a region's end (bytes of the
/// slot itself, which the decode side never reads).
const SLOT_GRANULES: u64 = 1024;

/// Index math of one side's prepared list: the pool's blocks (`[component][layer][page]`),
/// then every prefix of every bounce slot's components (`[slot][component][pages - 1]`), then
/// every prefix of every whole slot in granules (`[slot][granules - 1]`).
#[derive(Debug, Clone)]
pub(super) struct ListLayout {
    pages: u64,
    component_offsets: Vec<u64>,
    pool_blocks: u64,
    components: u64,
    pub(super) slot_pages: u64,
    slots: u64,
    /// Bytes of a whole slot, and of one granule of it.
    slot_bytes: u64,
    granule: u64,
}

impl ListLayout {
    /// `slot_bytes`: a whole slot's bytes (both sides compute the same from the geometry).
    pub(super) fn new(
        components: &[ComponentLayout],
        pages: u64,
        slot_pages: u64,
        slots: u64,
        slot_bytes: u64,
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
            slot_bytes,
            granule: slot_bytes
                .div_ceil(SLOT_GRANULES)
                .next_multiple_of(REGION_ALIGN as u64)
                .max(REGION_ALIGN as u64),
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
            .add_or(self.pool_blocks, what)?
            .add_or(self.slots.mul_or(self.granules(), what)?, what)
    }

    /// Whole-slot prefixes per slot.
    fn granules(&self) -> u64 {
        if self.slot_pages == 0 {
            0
        } else {
            self.slot_bytes.div_ceil(self.granule)
        }
    }

    /// The first `bytes` (1 up to the slot's bytes) of slot `slot`, rounded up to a granule
    /// (at most the whole slot).
    pub(super) fn whole(&self, slot: usize, bytes: u64) -> i32 {
        let k = bytes.div_ceil(self.granule).min(self.granules()).max(1);
        (self.pool_blocks
            + self.slots * self.components * self.slot_pages
            + slot as u64 * self.granules()
            + k
            - 1) as i32
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

    /// The (address, bytes) of every entry, in index order: `layer_base(c, l)` of the pool,
    /// `slot_base(s, c)` of each slot component and `slot_start(s)` of each slot.
    pub(super) fn descriptors(
        &self,
        components: &[ComponentLayout],
        layer_base: impl Fn(usize, usize) -> u64,
        slot_base: impl Fn(usize, usize) -> u64,
        slot_start: impl Fn(usize) -> u64,
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
        for s in 0..self.slots as usize {
            let base = slot_start(s);
            out.extend(
                (1..=self.granules()).map(|k| (base, (k * self.granule).min(self.slot_bytes))),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{CacheGeometry, LatentLayout, PoolGeometry};

    // A dense region of any length up to a slot is one descriptor from the slot's start that
    // covers it, past it by less than a granule, never past the slot.
    #[test]
    fn whole_slot_prefixes_cover_every_region() {
        let components =
            CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 3)).components();
        let slot_bytes = 1_000_003u64;
        let l = ListLayout::new(&components, 10, 4, 3, slot_bytes).unwrap();
        let d = l.descriptors(&components, |_, _| 0, |_, _| 0, |s| 1 << (40 + s));
        assert_eq!(d.len() as u64, l.len().unwrap());
        for slot in 0..3 {
            for bytes in [1, 255, 256, 977, 4096, slot_bytes - 1, slot_bytes] {
                let (addr, len) = d[l.whole(slot, bytes) as usize];
                assert_eq!(addr, 1 << (40 + slot));
                assert!(len >= bytes && len <= slot_bytes && len - bytes < l.granule);
            }
        }
        // No slots: no whole-slot prefixes.
        let none = ListLayout::new(&components, 10, 0, 0, slot_bytes).unwrap();
        assert_eq!(none.len().unwrap(), none.pool_blocks);
    }
}
