//! The bytes a run moves: the random pattern every rank fills its pool with, and the checks of
//! what landed in a decode pool against it.

use kvshard::backend::Backend;
use kvshard::chain::RequestChain;
use kvshard::copy::BlockSpace;
use kvshard::index::LocalPage;
use kvshard::pool::DevicePool;
use kvshard::transfer::Registration;
use kvshard::{Error, Result};
use rand::{RngCore, SeedableRng};

use super::PdConfig;
use crate::overflow;
use crate::synth::{mix, POISON};

/// Bytes of the random source every block is a window of.
const PATTERN_SPAN: usize = 8 << 20;

/// The random source every block of every rank is a window of: block (rank, component, layer,
/// page) starts at an offset hashed from the four, so a block in the wrong place (another page,
/// layer, component or rank) shows as different bytes.
#[derive(Debug, Clone)]
pub struct Pattern {
    bytes: Vec<u8>,
    seed: u64,
}

impl Pattern {
    /// The source of `seed`, long enough for blocks of up to `max_block` bytes.
    pub fn new(seed: u64, max_block: usize) -> Self {
        let mut bytes = vec![0u8; PATTERN_SPAN + max_block];
        rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut bytes);
        Self { bytes, seed }
    }

    /// The bytes of block (`rank`, component index `component`, `layer`, local `page`).
    pub fn block(&self, rank: u32, component: usize, layer: usize, page: u64, len: usize) -> &[u8] {
        let key = mix(self.seed
            ^ mix(u64::from(rank) << 48 ^ (component as u64) << 40 ^ (layer as u64) << 32)
            ^ page);
        let span = (self.bytes.len() - len.min(self.bytes.len())) as u64 + 1;
        let at = (key % span) as usize;
        &self.bytes[at..at + len.min(self.bytes.len())]
    }
}

/// The pattern of a run's geometry.
pub fn pattern(cfg: &PdConfig) -> Pattern {
    let max_block = cfg
        .shape
        .geometry()
        .components()
        .iter()
        .map(|c| c.block_bytes)
        .max()
        .unwrap_or(0);
    Pattern::new(cfg.shape.seed, max_block)
}

/// The bytes of one stored layer of component index `c` of `pool` (an allocated pool: layers
/// are slices of its storage).
pub(crate) fn layer_range(pool: &DevicePool, c: usize, layer: usize) -> Result<(usize, usize)> {
    let comp = &pool.components()[c];
    let storage = pool
        .storage()
        .ok_or_else(|| Error::InvalidArgument("pd pools are allocated by kvshard".into()))?;
    let base = pool.layer_bases(comp.component)?[layer];
    let offset = usize::try_from(base - storage.addr()).map_err(|_| overflow("a layer offset"))?;
    Ok((offset, pool.pages() as usize * comp.block_bytes))
}

/// Fills every block of `pool` (rank `rank`'s) with its pattern window, one write per layer
/// (each blocks the host until written).
pub fn fill_pool_sync(backend: &dyn Backend, pool: &DevicePool, pattern: &Pattern) -> Result<()> {
    let storage = pool
        .storage()
        .ok_or_else(|| Error::InvalidArgument("pd pools are allocated by kvshard".into()))?;
    for (c, comp) in pool.components().iter().enumerate() {
        for layer in 0..comp.layers() {
            let (offset, len) = layer_range(pool, c, layer)?;
            let mut data = Vec::with_capacity(len);
            for page in 0..pool.pages() {
                data.extend_from_slice(pattern.block(
                    pool.rank(),
                    c,
                    layer,
                    page,
                    comp.block_bytes,
                ));
            }
            backend.write_sync(storage, offset, &data)?;
        }
    }
    Ok(())
}

/// Checks the decode pool after `registration` was sent from `chain`: every registered block
/// holds its source rank's pattern window, and every other block from the page before the
/// lowest registered page to the page after the highest the poison (reading back only that
/// window keeps large pools quick to check). Blocks the host until `backend` has caught up.
pub fn verify_sync(
    backend: &dyn Backend,
    pool: &DevicePool,
    pattern: &Pattern,
    cfg: &PdConfig,
    chain: &RequestChain,
    registration: &Registration,
) -> Result<()> {
    let placement = cfg.shape.placement()?;
    verify_landed(backend, pool, registration, &mut |c, layer, position| {
        let src = chain
            .pages()?
            .get(position)
            .ok_or_else(|| Error::InvalidArgument(format!("position {position} past the chain")))?;
        let block = pool.components()[c].block_bytes;
        let (rank, local) = (placement.owner(*src), placement.local(*src));
        Ok(pattern.block(rank, c, layer, local.0, block).to_vec())
    })
}

/// Checks the decode pool after `registration` landed: every registered block equals what
/// `expected` says the block of (component index, stored layer, sequence position) is, and
/// every other block from the page before the lowest registered page to the page after the
/// highest holds the poison. Waits for `backend`.
pub(crate) fn verify_landed(
    backend: &dyn Backend,
    pool: &DevicePool,
    registration: &Registration,
    expected: &mut dyn FnMut(usize, usize, usize) -> Result<Vec<u8>>,
) -> Result<()> {
    let storage = pool
        .storage()
        .ok_or_else(|| Error::InvalidArgument("pd pools are allocated by kvshard".into()))?;
    let prefix = registration.prefix_pages;
    let registered = registration.pages.iter().chain(&registration.state_pages);
    let lo = registered
        .clone()
        .map(|p| p.0)
        .min()
        .unwrap_or(0)
        .saturating_sub(1);
    let hi = registered
        .map(|p| p.0 + 2)
        .max()
        .unwrap_or(0)
        .min(pool.pages());
    let window = usize::try_from(lo).map_err(|_| overflow("a page window"))?
        ..usize::try_from(hi.max(lo)).map_err(|_| overflow("a page window"))?;
    for (c, comp) in pool.components().iter().enumerate() {
        // Latent blocks go where the registration put each position after the prefix; the
        // indexer state of every position goes to its state page.
        let targets: Vec<(usize, LocalPage)> = if comp.component.is_indexer() {
            registration
                .state_pages
                .iter()
                .copied()
                .enumerate()
                .collect()
        } else {
            registration
                .pages
                .iter()
                .enumerate()
                .map(|(i, &p)| (prefix + i, p))
                .collect()
        };
        let block = comp.block_bytes;
        for layer in 0..comp.layers() {
            let (offset, _) = layer_range(pool, c, layer)?;
            let len = window.len() * block;
            let got = backend.read_sync(storage, offset + window.start * block, len)?;
            let mut want = vec![POISON; len];
            for &(position, dst) in &targets {
                let at = (dst.0 as usize - window.start) * block;
                let bytes = expected(c, layer, position)?;
                if bytes.len() != block {
                    return Err(Error::Verification(format!(
                        "{} bytes expected of a {block}-byte block",
                        bytes.len()
                    )));
                }
                want[at..at + block].copy_from_slice(&bytes);
            }
            if got != want {
                let page = window.start
                    + got
                        .chunks(block)
                        .zip(want.chunks(block))
                        .position(|(g, w)| g != w)
                        .unwrap_or(0);
                return Err(Error::Transfer {
                    request: registration.request,
                    reason: format!(
                        "decode pool differs at {} stored layer {layer} page {page}",
                        comp.component
                    ),
                });
            }
        }
    }
    Ok(())
}
