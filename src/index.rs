//! The index spaces of a sharded cache, each its own type, so that a page of one space can never
//! be passed where a page of another is meant.
//!
//! | type | what it numbers | same on every rank |
//! |---|---|---|
//! | [`LogicalPage`] | pages of the shard group's logical index space (the scheduler's, the radix tree's) | yes |
//! | [`LocalPage`] | pages of one rank's physical pool (an unsharded pool's pages are its local pages) | no |
//! | [`Slot`] | logical token slots: `64 * page + offset` | yes |
//! | [`ModelLayer`] | layers of the model, the draft's after the target's (layer 61 of a 61-layer model is the draft) | yes |
//! | [`StoredLayer`] | buffers of one component (indexer components skip shared-indexer layers; the draft's one layer is stored layer 0 of the draft components) | yes |
//!
//! Conversions are explicit: [`crate::shard::Placement`] maps logical pages and slots to local
//! ones and back; [`crate::geometry::ComponentLayout`] maps model layers to stored layers and
//! back. The raw number is the public field, for the engine's own tensors.

use std::fmt;

/// Tokens per page.
pub const PAGE_SIZE: usize = crate::abi::KVS_PAGE_SIZE as usize;

macro_rules! index {
    ($(#[$doc:meta])* $name:ident($raw:ty), $label:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        #[repr(transparent)]
        pub struct $name(pub $raw);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($label, " {}"), self.0)
            }
        }
    };
}

index!(
    /// A page of the shard group's logical index space.
    LogicalPage(u64),
    "logical page"
);
index!(
    /// A page of one rank's physical pool.
    LocalPage(u64),
    "local page"
);
index!(
    /// A logical token slot: token `offset` of logical page `slot / 64`.
    Slot(u64),
    "slot"
);
index!(
    /// A layer of the model: target layers `0..L`, then the draft's layer `L`.
    ModelLayer(usize),
    "model layer"
);
index!(
    /// One buffer of one component, in the component's own numbering.
    StoredLayer(usize),
    "stored layer"
);

impl LogicalPage {
    /// The slot of token `offset` (below 64) of this page, or `None` when it overflows.
    pub fn slot(self, offset: usize) -> Option<Slot> {
        self.0
            .checked_mul(PAGE_SIZE as u64)?
            .checked_add(offset as u64)
            .map(Slot)
    }
}

impl Slot {
    /// The logical page holding this slot.
    pub fn page(self) -> LogicalPage {
        LogicalPage(self.0 / PAGE_SIZE as u64)
    }

    /// The slot's offset inside its page.
    pub fn offset(self) -> usize {
        (self.0 % PAGE_SIZE as u64) as usize
    }
}

impl From<LogicalPage> for u64 {
    fn from(p: LogicalPage) -> u64 {
        p.0
    }
}

impl From<LocalPage> for u64 {
    fn from(p: LocalPage) -> u64 {
        p.0
    }
}

impl From<Slot> for u64 {
    fn from(s: Slot) -> u64 {
        s.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_and_pages_convert_explicitly() {
        let s = LogicalPage(3).slot(5).unwrap();
        assert_eq!(s, Slot(197));
        assert_eq!((s.page(), s.offset()), (LogicalPage(3), 5));
        assert_eq!(LogicalPage(u64::MAX).slot(0), None);
        assert_eq!(LocalPage(4).to_string(), "local page 4");
        assert_eq!(ModelLayer(61).to_string(), "model layer 61");
    }
}
