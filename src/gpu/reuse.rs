//! Memory whose driver free may wait for the whole device, kept for reuse instead of freed.
//!
//! `cuMemFree` of `cuMemAlloc` memory and `cuMemFreeHost` may synchronize the device, by the
//! driver's choice, and while they do, the driver holds other threads' CUDA calls too: on the
//! H200, with 60 ms of another stream's work queued, such a free on a thread of kvshard's own
//! held the engine thread's next event record for the rest of those 60 ms. So kvshard, like
//! PyTorch's caching allocators, does not give this memory back when its last handle goes:
//! once the work queued on it has completed (`backend::usage` drops an allocation only then),
//! it goes to this cache, and the next allocation of the same kind and context that fits takes
//! it. The driver gets it back only in calls that may block: [`release_sync`] (through
//! `backend::wait_for_frees_sync`), or an allocation that found the device or host full, which
//! releases the cache and tries once more.
//!
//! An allocation takes the smallest cached block that holds it, if that block is at most twice
//! its size plus 2 MiB (a larger one is left for a larger request). The cache holds only
//! memory callers have given up; [`cached_bytes`] says how much.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;

use crate::lock::lock;

/// What a cached block is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `cuMemAlloc` device memory.
    Device,
    /// `cuMemHostAlloc` pinned, device-mapped host memory.
    PinnedHost,
}

/// One cached block: its context (`CUcontext` as an integer, and the context itself, kept
/// alive: the memory lives as long as its context), bytes, and its addresses (the device
/// pointer, or the host pointer and its device alias).
#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub(crate) kind: Kind,
    pub(crate) ctx: usize,
    pub(crate) context: Option<Arc<CudaContext>>,
    pub(crate) len: usize,
    pub(crate) host: usize,
    pub(crate) device: u64,
}

/// Cached blocks, in the order they were kept.
#[derive(Debug, Default)]
struct Cache(Vec<Block>);

impl Cache {
    /// The smallest block of `kind` in context `ctx` that holds `len` bytes and is at most
    /// twice that plus [`SLACK`], taken out.
    fn take(&mut self, kind: Kind, ctx: usize, len: usize) -> Option<Block> {
        let most = len.saturating_mul(2).saturating_add(SLACK);
        let best = self
            .0
            .iter()
            .enumerate()
            .filter(|(_, b)| b.kind == kind && b.ctx == ctx && b.len >= len && b.len <= most)
            .min_by_key(|(_, b)| b.len)
            .map(|(i, _)| i)?;
        Some(self.0.swap_remove(best))
    }
}

static CACHE: Mutex<Cache> = Mutex::new(Cache(Vec::new()));

/// Slack an allocation accepts beyond its size.
const SLACK: usize = 2 << 20;

/// Keeps `block` for reuse. Its work must have completed.
pub(crate) fn keep(block: Block) {
    lock(&CACHE).0.push(block);
}

/// A cached block of `kind` in context `ctx` that holds `len` bytes, taken out of the cache.
pub(crate) fn take(kind: Kind, ctx: usize, len: usize) -> Option<Block> {
    lock(&CACHE).take(kind, ctx, len)
}

/// Every cached block, taken out of the cache, for the caller to free.
pub(crate) fn take_all() -> Vec<Block> {
    std::mem::take(&mut lock(&CACHE).0)
}

/// Bytes the cache holds, of either kind.
pub fn cached_bytes() -> u64 {
    lock(&CACHE).0.iter().map(|b| b.len as u64).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(kind: Kind, ctx: usize, len: usize) -> Block {
        Block {
            kind,
            ctx,
            context: None,
            len,
            host: 0,
            device: len as u64,
        }
    }

    #[test]
    fn an_allocation_takes_the_smallest_block_of_its_kind_and_context_that_fits() {
        let ctx = 7;
        let mut cache = Cache::default();
        cache.0.push(block(Kind::Device, ctx, 64 << 20));
        cache.0.push(block(Kind::Device, ctx, 8 << 20));
        cache.0.push(block(Kind::PinnedHost, ctx, 4 << 20));
        cache.0.push(block(Kind::Device, ctx + 1, 4 << 20));
        let mut take = |kind, ctx, len| cache.take(kind, ctx, len);
        // Too small, too large (past twice plus the slack), another kind, another context.
        assert!(take(Kind::Device, ctx, 100 << 20).is_none());
        assert!(take(Kind::Device, ctx, 1 << 20).is_none());
        assert_eq!(
            take(Kind::Device, ctx, 4 << 20).map(|b| b.len),
            Some(8 << 20)
        );
        assert_eq!(
            take(Kind::Device, ctx, 40 << 20).map(|b| b.len),
            Some(64 << 20)
        );
        assert!(take(Kind::Device, ctx, 40 << 20).is_none());
        assert_eq!(
            take(Kind::PinnedHost, ctx, 3 << 20).map(|b| b.len),
            Some(4 << 20)
        );
        assert_eq!(
            take(Kind::Device, ctx + 1, 4 << 20).map(|b| b.len),
            Some(4 << 20)
        );
    }
}
