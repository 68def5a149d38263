//! Geometry as a NIXL peer announces it on the control channel (`NixlPeer`): plain numbers out,
//! and a validated [`CacheGeometry`] back in.

use crate::error::{Error, Result};
use crate::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use crate::ipc::wire::WirePool;

fn wire_pool(p: &PoolGeometry) -> WirePool {
    WirePool {
        latent_row_bytes: p.latent.row_bytes() as u32,
        page_size: p.page_size as u32,
        indexer_head_dim: p.indexer_head_dim as u32,
        indexer_quant_block: p.indexer_quant_block as u32,
        indexer_layers: p.indexer_layers.clone(),
    }
}

fn pool_of(w: &WirePool) -> Result<PoolGeometry> {
    let latent = LatentLayout::ALL
        .into_iter()
        .find(|l| l.row_bytes() == w.latent_row_bytes as usize)
        .ok_or_else(|| {
            Error::InvalidGeometry(format!(
                "the peer's latent rows are {} B, a layout kvshard does not know",
                w.latent_row_bytes
            ))
        })?;
    Ok(PoolGeometry {
        latent,
        page_size: w.page_size as usize,
        indexer_head_dim: w.indexer_head_dim as usize,
        indexer_quant_block: w.indexer_quant_block as usize,
        indexer_layers: w.indexer_layers.clone(),
    })
}

/// The wire form of a geometry: (target, draft).
pub(crate) fn wire_geometry(g: &CacheGeometry) -> (WirePool, Option<WirePool>) {
    (wire_pool(&g.target), g.draft.as_ref().map(wire_pool))
}

/// The geometry a peer announced, validated.
pub(crate) fn geometry_of(target: &WirePool, draft: Option<&WirePool>) -> Result<CacheGeometry> {
    let g = CacheGeometry {
        target: pool_of(target)?,
        draft: draft.map(pool_of).transpose()?,
    };
    g.validate()?;
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_round_trips_through_the_wire() {
        for g in [
            CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
                LatentLayout::Fp8Scaled,
                vec![true, false, true],
            )),
            CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Bf16, 2)),
        ] {
            let (t, d) = wire_geometry(&g);
            assert_eq!(geometry_of(&t, d.as_ref()).unwrap(), g);
        }
        let (mut t, _) = wire_geometry(&CacheGeometry::target_only(PoolGeometry::new(
            LatentLayout::Fp8Trtllm,
            1,
        )));
        t.latent_row_bytes = 100;
        assert!(geometry_of(&t, None).is_err());
    }
}
