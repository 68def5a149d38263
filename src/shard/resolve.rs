//! Owner-local index resolution (DOMAIN.md section 3) and scratch-row translation: the pure CPU
//! reference on slices, and the host side of the `kvs_resolve` / `kvs_scratch_rows` kernels
//! (cuda/resolve.cu) on any [`Backend`].
//!
//! [`Resolver`] owns what one backend's `kvs_resolve` launches need besides the input: the
//! outputs, sized for a fixed capacity, and the tile state: two Fenwick trees of tile counts that
//! launches alternate between, each launch zeroing what the previous one left in the other tree,
//! so the state is cleared only at creation.

use crate::abi;
use crate::backend::{
    i64s_from_bytes, resolve_state_bytes, resolve_state_tiles, resolve_tiles, Backend, Buffer,
    MemoryKind,
};
use crate::error::{Error, Result};
use crate::geometry::PAGE_SIZE;
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

fn check_rank(placement: Placement, rank: u32) -> Result<()> {
    if rank >= placement.shard() {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} of a shard of {}",
            placement.shard()
        )));
    }
    Ok(())
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
    check_rank(placement, rank)?;
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
            ResolveMode::Tokens => (placement.slot_owner(entry), placement.local_row(entry)),
            ResolveMode::Pages => (placement.owner(entry), placement.local_page(entry)),
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

fn check_i64s(buffer: &Buffer, count: usize, align: u64, what: &str) -> Result<()> {
    let fits = count
        .checked_mul(8)
        .is_some_and(|bytes| bytes <= buffer.len());
    if !fits || buffer.addr() % align != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what}: {}-byte buffer at {:#x} for {count} int64s ({align}-byte aligned)",
            buffer.len(),
            buffer.addr()
        )));
    }
    Ok(())
}

/// Translates `n` token slots into scratch rows on `backend` (`kvs_scratch_rows`): `out[i]`
/// gets the row [`scratch_rows`] gives for `slots[i]`, or -1 for padding. The first `table_len`
/// int64s of `page_table` map logical pages to scratch pages. Waits for the kernel; a slot it
/// rejects (see [`scratch_rows`]) gets -1 and fails the call with [`Error::KernelRejected`]
/// naming the smallest such position, after every other row has been written.
pub fn scratch_rows_device<B: Backend>(
    backend: &B,
    slots: &Buffer,
    n: usize,
    page_table: &Buffer,
    table_len: usize,
    scratch_rows: u64,
    out: &Buffer,
) -> Result<()> {
    check_i64s(slots, n, 8, "scratch slots")?;
    check_i64s(page_table, table_len, 8, "scratch page table")?;
    check_i64s(out, n, 8, "scratch rows output")?;
    let params = abi::kvs_scratch_rows_params {
        slots: slots.addr(),
        num_slots: n as u64,
        page_table: page_table.addr(),
        table_len: table_len as u64,
        scratch_rows,
        out_rows: out.addr(),
        ..Default::default()
    };
    // SAFETY: the kernel reads slots[0..n], reads page_table only below table_len, and writes
    // out[0..n]; each buffer was checked to hold that many aligned int64s, and the caller's
    // borrows keep them alive until the synchronize below has seen the work finish.
    unsafe { backend.scratch_rows(params)? };
    backend.synchronize()
}

/// Which of the two trees in the tile state the next launch uses, and how many nodes the
/// previous launch left non-zero in the other one (the next launch zeroes them, so the tree after
/// it is zero again).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Trees {
    parity: u32,
    dirty: u32,
}

impl Trees {
    /// Once a launch of `tiles` tiles is enqueued: the next one uses the other tree and clears
    /// the nodes this one used.
    fn launched(&mut self, tiles: u32) {
        self.parity ^= 1;
        self.dirty = tiles;
    }
}

/// Device state for `kvs_resolve` on one backend: output buffers for up to `capacity` entries
/// and the tile state, with which of its trees the next launch uses.
#[derive(Debug)]
pub struct Resolver {
    backend: &'static str,
    capacity: usize,
    tile_state: Buffer,
    positions: Buffer,
    local: Buffer,
    count: Buffer,
    trees: Trees,
}

impl Resolver {
    /// A resolver for up to `capacity` entries per launch (1 to 2^31 - 1: positions are i32).
    /// Allocates its buffers on `backend` and enqueues the zero-fill of the tile state.
    pub fn new<B: Backend>(backend: &B, capacity: usize) -> Result<Resolver> {
        if capacity == 0 || capacity >= 1 << 31 {
            return Err(Error::InvalidArgument(format!(
                "resolver capacity {capacity} (must be 1 to 2^31 - 1 entries)"
            )));
        }
        let tile_state = backend.alloc(
            resolve_state_bytes(capacity as u64) as usize,
            MemoryKind::Device,
        )?;
        backend.fill(&tile_state, 0)?;
        Ok(Resolver {
            backend: backend.name(),
            capacity,
            tile_state,
            positions: backend.alloc(4 * capacity, MemoryKind::Device)?,
            local: backend.alloc(8 * capacity, MemoryKind::Device)?,
            count: backend.alloc(8, MemoryKind::Device)?,
            trees: Trees::default(),
        })
    }

    /// Most entries one launch may resolve.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Output positions: `int32[capacity]`, the first `count` valid after a launch.
    pub fn positions(&self) -> &Buffer {
        &self.positions
    }

    /// Output local rows or pages: `int64[capacity]`, the first `count` valid after a launch.
    pub fn local(&self) -> &Buffer {
        &self.local
    }

    /// Output count: one uint64, the number of owned entries of the last launch.
    pub fn count_buffer(&self) -> &Buffer {
        &self.count
    }

    fn check(&self, backend: &str, n: usize, placement: Placement, rank: u32) -> Result<()> {
        if backend != self.backend {
            return Err(Error::InvalidArgument(format!(
                "resolver made for the {} backend used with the {backend} backend",
                self.backend
            )));
        }
        if n > self.capacity {
            return Err(Error::InvalidArgument(format!(
                "{n} entries for a resolver of capacity {}",
                self.capacity
            )));
        }
        check_rank(placement, rank)
    }

    /// Enqueues `kvs_resolve` of the `n` int64 entries at device address `entries` for `rank`
    /// on `backend`'s stream; nothing waits. When it has run, [`Self::count_buffer`] holds the
    /// number of owned entries and the first that many elements of [`Self::positions`] and
    /// [`Self::local`] hold them in input order. An entry `>= limit` is skipped and reported:
    /// the next [`Backend::synchronize`] fails with [`Error::KernelRejected`] naming the smallest
    /// bad position. For `n == 0` nothing is launched; the count is zeroed (stream-ordered).
    /// The next launch overwrites the outputs, so whatever reads them must be ordered before it.
    ///
    /// # Safety
    /// - `entries` must be an address of `backend` holding `n` int64s, valid until the launch
    ///   has finished (an address that is not 8-byte aligned is refused);
    /// - the resolver must be used with the backend it was made on (only its kind is checked)
    ///   and must outlive the launch;
    /// - launches of one resolver must never overlap: a launch (this one or a later one, also
    ///   through [`Self::resolve`]) may be enqueued on another stream than the previous one only
    ///   once the previous one has finished.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn resolve_device<B: Backend>(
        &mut self,
        backend: &B,
        entries: u64,
        n: usize,
        placement: Placement,
        rank: u32,
        mode: ResolveMode,
        limit: u64,
    ) -> Result<()> {
        self.check(backend.name(), n, placement, rank)?;
        if n == 0 {
            return backend.fill(&self.count, 0);
        }
        if entries % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "resolve entries at {entries:#x} (int64 entries must be 8-byte aligned)"
            )));
        }
        let params = abi::kvs_resolve_params {
            entries,
            num_entries: n as u64,
            limit,
            out_positions: self.positions.addr(),
            out_local: self.local.addr(),
            out_count: self.count.addr(),
            tile_state: self.tile_state.addr(),
            shard: placement.shard(),
            rank,
            mode: mode.abi(),
            parity: self.trees.parity,
            state_tiles: resolve_state_tiles(self.capacity as u64) as u32,
            clear_tiles: self.trees.dirty,
            ..Default::default()
        };
        // SAFETY: the outputs hold `capacity >= n` elements and the tile state two trees of one
        // node per tile of `capacity` entries, the one this launch uses zero (see `Trees`); the
        // input and the ordering are the caller's contract.
        unsafe { backend.resolve(params)? };
        self.trees.launched(resolve_tiles(n as u64) as u32);
        Ok(())
    }

    /// Resolves the first `n` int64 entries of `entries` for `rank` and returns the owned ones:
    /// enqueues [`Self::resolve_device`], waits, and reads the outputs back. An entry `>= limit`
    /// fails the call with [`Error::KernelRejected`] naming the smallest bad position. `n == 0`
    /// launches nothing. `backend` must be the one the resolver was made on (its kind is
    /// checked) and `entries` a buffer of it.
    #[allow(clippy::too_many_arguments)]
    pub fn resolve<B: Backend>(
        &mut self,
        backend: &B,
        entries: &Buffer,
        n: usize,
        placement: Placement,
        rank: u32,
        mode: ResolveMode,
        limit: u64,
    ) -> Result<Resolved> {
        self.check(backend.name(), n, placement, rank)?;
        if n == 0 {
            return Ok(Resolved::default());
        }
        check_i64s(entries, n, 16, "resolve entries")?;
        // SAFETY: `entries` was checked to hold n aligned int64s and is borrowed until the
        // synchronize below, which also finishes this launch before `&mut self` (and with it
        // the outputs) is released; earlier launches are the contract of resolve_device.
        unsafe { self.resolve_device(backend, entries.addr(), n, placement, rank, mode, limit)? };
        backend.synchronize()?;
        let count = u64::from_le_bytes(
            backend
                .read(&self.count, 0, 8)?
                .try_into()
                .map_err(|_| Error::InvalidArgument("kvs_resolve count read back short".into()))?,
        );
        if count > n as u64 {
            return Err(Error::InvalidArgument(format!(
                "kvs_resolve counted {count} owned entries of {n}"
            )));
        }
        let count = count as usize;
        let positions = backend
            .read(&self.positions, 0, 4 * count)?
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let local = i64s_from_bytes(&backend.read(&self.local, 0, 8 * count)?)
            .into_iter()
            .map(|l| l as u64)
            .collect();
        Ok(Resolved { positions, local })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Models what launches leave in the two trees: every launch must find the tree it
        /// uses zero, whatever the sizes of the launches before it.
        #[test]
        fn every_launch_finds_its_tree_zero(sizes in proptest::collection::vec(1usize..=64, 1..100)) {
            let mut trees = Trees::default();
            let mut model = [[0u8; 64]; 2];
            for (launch, tiles) in sizes.into_iter().enumerate() {
                let (used, other) = (trees.parity as usize, trees.parity as usize ^ 1);
                proptest::prop_assert!(
                    model[used][..tiles].iter().all(|&n| n == 0),
                    "launch {} ({} tiles) found tree {} dirty", launch, tiles, used
                );
                model[other][..trees.dirty as usize].fill(0);
                model[used][..tiles].fill(1);
                trees.launched(tiles as u32);
            }
        }
    }
}
