//! Owner-local index resolution (docs/design.md, "Ownership") and scratch-row translation: the
//! pure CPU references on slices, which the `kvs_resolve` / `kvs_scratch_rows` kernels (and
//! their host side, `crate::copy::Resolver`) are tested against.

use crate::abi;
use crate::error::{Error, Result};
use crate::geometry::PAGE_SIZE;
use crate::index::{LogicalPage, Slot};
use crate::shard::Placement;

/// What the entries of a resolution are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResolveMode {
    /// Logical token slots; owned entries resolve to local rows.
    Tokens,
    /// Logical pages; owned entries resolve to local pages.
    Pages,
}

impl ResolveMode {
    /// The `KVS_RESOLVE_*` code of the mode.
    pub fn abi(self) -> u32 {
        match self {
            ResolveMode::Tokens => abi::KVS_RESOLVE_TOKENS,
            ResolveMode::Pages => abi::KVS_RESOLVE_PAGES,
        }
    }
}

/// The entries one rank owns, in input order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Resolved {
    /// Position of each owned entry in the input.
    pub positions: Vec<u32>,
    /// Local row (tokens) or local page (pages) of each owned entry.
    pub local: Vec<u64>,
}

/// The entries of `entries` that `rank` owns, with their positions and local indices: the
/// reference `kvs_resolve` is tested against. Negative entries are padding (owned by no one);
/// an entry `>= limit` fails the call with [`Error::OutOfRange`] naming the first one.
pub fn resolve_owned(
    placement: Placement,
    rank: u32,
    mode: ResolveMode,
    entries: &[i64],
    limit: u64,
) -> Result<Resolved> {
    placement.check_rank(rank)?;
    if u32::try_from(entries.len().saturating_sub(1)).is_err() {
        return Err(Error::InvalidArgument(format!(
            "{} entries (positions are 32-bit)",
            entries.len()
        )));
    }
    let mut out = Resolved::default();
    let expected = entries.len() / placement.shard() as usize + 1;
    out.positions.reserve(expected);
    out.local.reserve(expected);
    for (i, &e) in entries.iter().enumerate() {
        if e < 0 {
            continue;
        }
        let entry = e as u64;
        if entry >= limit {
            return Err(Error::OutOfRange {
                what: "resolve entry",
                index: e,
                limit,
            });
        }
        let (owner, local) = match mode {
            ResolveMode::Tokens => (
                placement.slot_owner(Slot(entry)),
                placement.local_row(Slot(entry)),
            ),
            ResolveMode::Pages => (
                placement.owner(LogicalPage(entry)),
                placement.local(LogicalPage(entry)).0,
            ),
        };
        if owner == rank {
            // Fits: the length check above bounds every position to u32.
            out.positions.push(i as u32);
            out.local.push(local);
        }
    }
    Ok(out)
}

/// Scratch rows of token slots: `page_table[slot / 64] * 64 + slot % 64` for every slot, -1 for
/// padding (negative) slots: the reference `kvs_scratch_rows` is tested against. A slot whose
/// page lies beyond the table, is unmapped (negative table entry), or maps to a row
/// `>= scratch_rows` fails the call, naming the first such slot.
pub fn scratch_rows(slots: &[i64], page_table: &[i64], scratch_rows: u64) -> Result<Vec<i64>> {
    let page_size = PAGE_SIZE as u64;
    slots
        .iter()
        .enumerate()
        .map(|(i, &slot)| {
            if slot < 0 {
                return Ok(-1);
            }
            let page = slot as u64 / page_size;
            let Some(&scratch_page) = usize::try_from(page).ok().and_then(|p| page_table.get(p))
            else {
                return Err(Error::OutOfRange {
                    what: "scratch slot (page beyond the page table)",
                    index: slot,
                    limit: page_table.len() as u64 * page_size,
                });
            };
            if scratch_page < 0 {
                return Err(Error::InvalidArgument(format!(
                    "slot {slot} (entry {i}) lies on unmapped page {page}"
                )));
            }
            // Checked, unlike the kernel's wrapping product: a huge table entry is an error.
            (scratch_page as u64)
                .checked_mul(page_size)
                .map(|row| row + slot as u64 % page_size)
                .filter(|&row| row < scratch_rows)
                .map(|row| row as i64)
                .ok_or(Error::OutOfRange {
                    what: "scratch row",
                    index: scratch_page
                        .saturating_mul(PAGE_SIZE as i64)
                        .saturating_add(slot % PAGE_SIZE as i64),
                    limit: scratch_rows,
                })
        })
        .collect()
}
