//! The device side of owner-local resolution: [`Resolver`] owns what one backend's
//! `kvs_resolve` launches need besides the input (the outputs, sized for a fixed capacity, and
//! the tile state: two Fenwick trees of tile counts that launches alternate between, each
//! launch zeroing what the previous one left in the other tree, so the state is cleared only at
//! creation), and [`scratch_rows_device_sync`] runs `kvs_scratch_rows`. The CPU references they are
//! tested against are `crate::shard::resolve_owned` and `crate::shard::scratch_rows`.

use crate::abi;
use crate::backend::{
    i64s_from_bytes, ordered, resolve_state_bytes, resolve_state_tiles, resolve_tiles,
    AddressSpace, Backend, Buffer, MemoryKind,
};
use crate::error::{Error, Result};
use crate::shard::{Placement, ResolveMode, Resolved};

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
/// gets the row [`crate::shard::scratch_rows`] gives for `slots[i]`, or -1 for padding. The first `table_len`
/// int64s of `page_table` map logical pages to scratch pages. Waits for the kernel; a slot it
/// rejects (see [`crate::shard::scratch_rows`]) gets -1 and fails the call with [`Error::KernelRejected`]
/// naming the smallest such position, after every other row has been written.
pub fn scratch_rows_device_sync(
    backend: &dyn Backend,
    slots: &Buffer,
    n: usize,
    page_table: &Buffer,
    table_len: usize,
    scratch_rows: u64,
    out: &Buffer,
) -> Result<()> {
    for (buffer, what) in [
        (slots, "scratch slots"),
        (page_table, "scratch page table"),
        (out, "scratch rows output"),
    ] {
        backend.check(buffer, what)?;
    }
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
    ordered(
        backend,
        &[slots.usage(), page_table.usage()],
        &[out.usage()],
        || {
            // SAFETY: the kernel reads slots[0..n], reads page_table only below table_len, and
            // writes out[0..n]; each buffer was checked to hold that many aligned int64s, and
            // their usages keep them until the launch has run.
            unsafe { backend.scratch_rows(params) }
        },
    )?;
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
    space: AddressSpace,
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
    pub fn new(backend: &dyn Backend, capacity: usize) -> Result<Resolver> {
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
            space: backend.address_space(),
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

    fn check(
        &self,
        backend: &dyn Backend,
        n: usize,
        placement: Placement,
        rank: u32,
    ) -> Result<()> {
        crate::backend::check_space(backend.address_space(), self.space, "a resolver")?;
        if n > self.capacity {
            return Err(Error::InvalidArgument(format!(
                "{n} entries for a resolver of capacity {}",
                self.capacity
            )));
        }
        placement.check_rank(rank)
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
    ///   through [`Self::resolve_sync`]) may be enqueued on another stream than the previous one only
    ///   once the previous one has finished.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn resolve_device(
        &mut self,
        backend: &dyn Backend,
        entries: u64,
        n: usize,
        placement: Placement,
        rank: u32,
        mode: ResolveMode,
        limit: u64,
    ) -> Result<()> {
        self.check(backend, n, placement, rank)?;
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
        let outputs = [
            self.positions.usage(),
            self.local.usage(),
            self.count.usage(),
            self.tile_state.usage(),
        ];
        ordered(backend, &[], &outputs, || {
            // SAFETY: the outputs hold `capacity >= n` elements and the tile state two trees of
            // one node per tile of `capacity` entries, the one this launch uses zero (see
            // `Trees`), all kept by their usages until the launch has run; the input and the
            // ordering are the caller's contract.
            unsafe { backend.resolve(params) }
        })?;
        self.trees.launched(resolve_tiles(n as u64) as u32);
        Ok(())
    }

    /// Resolves the first `n` int64 entries of `entries` for `rank` and returns the owned ones:
    /// enqueues [`Self::resolve_device`], waits, and reads the outputs back. An entry `>= limit`
    /// fails the call with [`Error::KernelRejected`] naming the smallest bad position. `n == 0`
    /// launches nothing. `backend` must be the one the resolver was made on (its kind is
    /// checked) and `entries` a buffer of it.
    #[allow(clippy::too_many_arguments)]
    pub fn resolve_sync(
        &mut self,
        backend: &dyn Backend,
        entries: &Buffer,
        n: usize,
        placement: Placement,
        rank: u32,
        mode: ResolveMode,
        limit: u64,
    ) -> Result<Resolved> {
        self.check(backend, n, placement, rank)?;
        backend.check(entries, "resolve entries")?;
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
                .read_sync(&self.count, 0, 8)?
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
            .read_sync(&self.positions, 0, 4 * count)?
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let local = i64s_from_bytes(&backend.read_sync(&self.local, 0, 8 * count)?)
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
