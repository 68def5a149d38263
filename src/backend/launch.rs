//! Launch shapes and the kernel a launch takes: the grid of a copy kernel ([`Launch`]), the
//! kernel families and the threads per CTA each is compiled for, which variant of a kernel a
//! launch's parameters pick, and the work units and tile state a launch is cut into.

use super::Backend;
use crate::abi;
use crate::error::{Error, Result};
use crate::gpu::{kernels, KernelFn};

/// Grid shape of a copy kernel: transfers share SMs with the forward pass, so the caller picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Launch {
    /// CTAs.
    pub ctas: u32,
    /// Threads per CTA (a multiple of 32; at most what the kernel was compiled for, which
    /// [`Backend::max_threads`] says).
    pub threads: u32,
}

impl Launch {
    /// `ctas` CTAs of as many threads as `backend`'s copy kernels take (1024 on the H200):
    /// the shape for host I/O, where bytes in flight per CTA decide the bandwidth.
    pub fn host_io(backend: &dyn Backend, ctas: u32) -> Self {
        Self {
            ctas,
            threads: backend.max_threads(KernelFamily::Copy),
        }
    }

    /// Checks the shape a kernel of at most `max_threads` threads per CTA can take
    /// ([`Backend::max_threads`] on a device; `abi::KVS_COPY_THREADS` before one is open):
    /// 1 to [`Launch::MAX_CTAS`] CTAs, a multiple of 32 threads, at most `max_threads`. Every
    /// launch is checked so; an engine checks a configured shape up front.
    pub fn validate(&self, max_threads: u32) -> Result<()> {
        if self.ctas == 0
            || self.ctas > Self::MAX_CTAS
            || self.threads == 0
            || self.threads % 32 != 0
            || self.threads > max_threads
        {
            return Err(Error::InvalidArgument(format!(
                "launch of {} CTAs x {} threads (need 1 to {} CTAs, a multiple of 32 threads, at most {max_threads})",
                self.ctas,
                self.threads,
                Self::MAX_CTAS
            )));
        }
        Ok(())
    }

    /// Most CTAs a launch takes: CUDA's largest grid (`2^31 - 1` blocks in x).
    pub const MAX_CTAS: u32 = i32::MAX as u32;
}

/// The kernel families a launch shape is chosen for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelFamily {
    /// `kvs_copy_blocks` and `kvs_copy_ranges`.
    Copy,
    /// `kvs_write_rows`.
    WriteRows,
    /// `kvs_decode_scatter`.
    DecodeScatter,
}

/// Units `kvs_write_rows` splits a write of `slots` tokens over `pairs` layer pairs into.
pub fn write_units(slots: u64, pairs: u32) -> u64 {
    slots
        .div_ceil(u64::from(abi::KVS_WRITE_GROUP))
        .saturating_mul(u64::from(pairs.div_ceil(abi::KVS_WRITE_PAIR_BLOCK)))
}

/// The `kvs_resolve` kernel for `p`: one per entry kind and shard-size class (cuda/resolve.cu
/// says why). The CPU twin reports errors under the same name.
pub(crate) fn resolve_kernel(p: &abi::kvs_resolve_params) -> KernelFn<abi::kvs_resolve_params> {
    match (p.mode == abi::KVS_RESOLVE_TOKENS, p.shard.is_power_of_two()) {
        (true, true) => kernels::RESOLVE_TOKENS_POW2,
        (true, false) => kernels::RESOLVE_TOKENS,
        (false, true) => kernels::RESOLVE_PAGES_POW2,
        (false, false) => kernels::RESOLVE_PAGES,
    }
}

/// The `kvs_decode_scatter` kernel for `p` (checked by `check::decode_scatter`): a direct
/// launch takes the pages kernel where the layout keeps pages whole, else the rows kernel of the
/// launch's latent rows; a packing or unpacking one the pack or unpack kernel of those rows
/// (cuda/decode_scatter.cu says why there are ten). The CPU twin reports errors under the
/// same name.
pub(crate) fn decode_scatter_kernel(
    p: &abi::kvs_decode_scatter_params,
) -> KernelFn<abi::kvs_decode_scatter_params> {
    if p.mode == abi::KVS_DECODE_DIRECT && page_granular(p) {
        return kernels::DECODE_SCATTER_PAGES;
    }
    let latent = p.components[..(p.num_components as usize).min(p.components.len())]
        .iter()
        .find(|c| c.kind == abi::KVS_ROWS_LATENT)
        .map(|c| c.row_bytes);
    // By the latent rows: 576 bytes, or a launch of indexer components only (every rows kernel
    // moves those).
    let [rows_576, rows_656, rows_1152] = match p.mode {
        abi::KVS_DECODE_PACK => [
            kernels::DECODE_PACK_ROWS_576,
            kernels::DECODE_PACK_ROWS_656,
            kernels::DECODE_PACK_ROWS_1152,
        ],
        abi::KVS_DECODE_UNPACK => [
            kernels::DECODE_UNPACK_ROWS_576,
            kernels::DECODE_UNPACK_ROWS_656,
            kernels::DECODE_UNPACK_ROWS_1152,
        ],
        _ => [
            kernels::DECODE_SCATTER_ROWS_576,
            kernels::DECODE_SCATTER_ROWS_656,
            kernels::DECODE_SCATTER_ROWS_1152,
        ],
    };
    match latent {
        Some(abi::KVS_LATENT_SCALED_ROW_BYTES) => rows_656,
        Some(abi::KVS_LATENT_BF16_ROW_BYTES) => rows_1152,
        _ => rows_576,
    }
}

/// Whether the launch's layout keeps pages whole: one rank, or an interleave of whole pages.
fn page_granular(p: &abi::kvs_decode_scatter_params) -> bool {
    p.num_ranks == 1 || u64::from(p.interleave) % crate::geometry::PAGE_SIZE as u64 == 0
}

/// Units of a `kvs_decode_scatter` launch (`cuda/abi.h`): a (pair, entry) of each section,
/// the latent section's cut into `64 / KVS_DECODE_SLICE_ROWS` slices where a DIRECT launch
/// takes a rows kernel; `None` past 64 bits. The work queue's base advances by this.
pub(crate) fn decode_scatter_units(p: &abi::kvs_decode_scatter_params) -> Option<u64> {
    let slices = if p.mode == abi::KVS_DECODE_DIRECT && !page_granular(p) {
        u64::from(abi::KVS_PAGE_SIZE / abi::KVS_DECODE_SLICE_ROWS)
    } else {
        1
    };
    let kv = u64::from(p.num_kv_pairs)
        .checked_mul(p.num_entries)?
        .checked_mul(slices)?;
    let state =
        u64::from(p.num_pairs.checked_sub(p.num_kv_pairs)?).checked_mul(p.num_state_entries)?;
    kv.checked_add(state)
}

/// Tiles (one CTA each) `kvs_resolve` uses for `entries` entries.
pub fn resolve_tiles(entries: u64) -> u64 {
    entries.div_ceil(u64::from(abi::KVS_RESOLVE_TILE))
}

/// Nodes per tree of the tile state `kvs_resolve` needs for up to `entries` entries: one per
/// tile, rounded up to whole 128-byte lines (the two trees interleave by lines).
pub fn resolve_state_tiles(entries: u64) -> u64 {
    resolve_tiles(entries).next_multiple_of(u64::from(abi::KVS_RESOLVE_LINE_NODES))
}

/// Bytes of tile state `kvs_resolve` needs for up to `entries` entries: two trees of
/// [`resolve_state_tiles`] uint64 nodes.
pub fn resolve_state_bytes(entries: u64) -> u64 {
    2 * 8 * resolve_state_tiles(entries)
}

/// Threads per CTA each kernel family is compiled for (`cuda/abi.h`): what the CPU twin
/// accepts, so a launch shape valid there is valid on every embedded architecture.
pub(crate) fn compiled_max_threads(family: KernelFamily) -> u32 {
    match family {
        KernelFamily::Copy => abi::KVS_COPY_THREADS,
        KernelFamily::WriteRows => abi::KVS_WRITE_THREADS,
        KernelFamily::DecodeScatter => abi::KVS_DECODE_THREADS,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(mode: u32, ranks: u32, interleave: u32) -> abi::kvs_decode_scatter_params {
        abi::kvs_decode_scatter_params {
            num_pairs: 5,
            num_kv_pairs: 3,
            num_entries: 7,
            num_state_entries: 11,
            num_ranks: ranks,
            interleave,
            mode,
            ..Default::default()
        }
    }

    #[test]
    fn decode_scatter_units_slice_the_latent_section_of_direct_rows_launches_only() {
        // 3 latent pairs x 7 entries, 2 state pairs x 11 entries.
        let slices = u64::from(abi::KVS_PAGE_SIZE / abi::KVS_DECODE_SLICE_ROWS);
        assert_eq!(
            decode_scatter_units(&params(abi::KVS_DECODE_DIRECT, 4, 1)),
            Some(21 * slices + 22)
        );
        // A unit a page: pages kept whole (the pages kernel), and packing and unpacking.
        for (mode, ranks, interleave) in [
            (abi::KVS_DECODE_DIRECT, 4, 64),
            (abi::KVS_DECODE_DIRECT, 1, 1),
            (abi::KVS_DECODE_PACK, 4, 1),
            (abi::KVS_DECODE_UNPACK, 4, 1),
        ] {
            let p = params(mode, ranks, interleave);
            assert_eq!(
                decode_scatter_units(&p),
                Some(43),
                "{mode} {ranks} {interleave}"
            );
        }
        // Past 64 bits once sliced (whole pages still fit), or more latent pairs than pairs:
        // none.
        let mut p = params(abi::KVS_DECODE_PACK, 4, 1);
        (p.num_pairs, p.num_kv_pairs, p.num_entries) = (1, 1, u64::MAX / 2);
        assert_eq!(decode_scatter_units(&p), Some(u64::MAX / 2));
        p.mode = abi::KVS_DECODE_DIRECT;
        assert_eq!(decode_scatter_units(&p), None);
        p = params(abi::KVS_DECODE_DIRECT, 4, 1);
        p.num_kv_pairs = 6;
        assert_eq!(decode_scatter_units(&p), None);
    }
}
