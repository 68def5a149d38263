//! Byte layouts of the DSA KV cache (docs/design.md, "Byte layouts"): latent rows, indexer page blocks,
//! and the geometry of a target pool (L layers) and its single-layer MTP draft pool.
//!
//! Geometry is plain data with public fields, because it also describes the *other* side of a
//! transfer (what a decode server registered); [`PoolGeometry::validate`] checks one side is
//! one kvshard supports, and [`CacheGeometry::validate_pd`] that two sides agree, naming the
//! first property that differs.

use std::fmt;

use crate::error::{Checked, Error, Result};
use crate::index::{ModelLayer, StoredLayer};

pub use crate::index::PAGE_SIZE;
/// Latent "nope" elements per token.
pub const KV_LORA_RANK: usize = crate::abi::KVS_KV_LORA_RANK as usize;
/// Latent rope elements per token.
pub const ROPE_DIM: usize = crate::abi::KVS_ROPE_DIM as usize;
/// Elements of one latent row (nope + rope).
pub const LATENT_DIM: usize = KV_LORA_RANK + ROPE_DIM;
/// Indexer key elements per token.
pub const INDEXER_HEAD_DIM: usize = crate::abi::KVS_INDEXER_HEAD_DIM as usize;
/// Elements sharing one indexer scale.
pub const INDEXER_QUANT_BLOCK: usize = 128;
/// Bytes of one page-major indexer block: 64 x 128 e4m3 keys, then 64 f32 scales.
pub const INDEXER_PAGE_BYTES: usize = crate::abi::KVS_INDEXER_PAGE_BYTES as usize;
/// Offset of the scales inside an indexer block.
pub const INDEXER_SCALES_OFFSET: usize = crate::abi::KVS_INDEXER_SCALES_OFFSET as usize;
/// Bytes of one token's indexer row (key + scale).
pub const INDEXER_ROW_BYTES: usize = crate::abi::KVS_INDEXER_ROW_BYTES as usize;
/// Elements per FP8 scale tile of the "scaled" latent layout.
pub const LATENT_SCALE_TILE: usize = crate::abi::KVS_LATENT_SCALE_TILE as usize;

/// How a latent KV row is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LatentLayout {
    /// FP8 E4M3 "trtllm": 512 e4m3 nope + 64 e4m3 rope, scale 1.0 (576 bytes). The sharded DSA
    /// path uses this one.
    Fp8Trtllm,
    /// FP8 E4M3 "scaled" (FlashMLA): 512 e4m3 nope, four f32 tile scales, 64 bf16 rope (656 bytes).
    Fp8Scaled,
    /// bf16 nope + rope (1152 bytes).
    Bf16,
}

impl LatentLayout {
    /// All layouts, for tests and benchmarks that cover each.
    pub const ALL: [LatentLayout; 3] = [Self::Fp8Trtllm, Self::Fp8Scaled, Self::Bf16];

    /// Bytes of one token's row.
    pub const fn row_bytes(self) -> usize {
        (match self {
            Self::Fp8Trtllm => crate::abi::KVS_LATENT_TRTLLM_ROW_BYTES,
            Self::Fp8Scaled => crate::abi::KVS_LATENT_SCALED_ROW_BYTES,
            Self::Bf16 => crate::abi::KVS_LATENT_BF16_ROW_BYTES,
        }) as usize
    }

    /// Bytes of one (page, layer) block.
    pub const fn block_bytes(self) -> usize {
        self.row_bytes() * PAGE_SIZE
    }

    /// The kernel ABI code of this layout.
    pub(crate) const fn abi(self) -> u32 {
        match self {
            Self::Fp8Trtllm => crate::abi::KVS_LATENT_FP8_TRTLLM,
            Self::Fp8Scaled => crate::abi::KVS_LATENT_FP8_SCALED,
            Self::Bf16 => crate::abi::KVS_LATENT_BF16,
        }
    }
}

impl fmt::Display for LatentLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Self::Fp8Trtllm => "fp8-e4m3-trtllm",
            Self::Fp8Scaled => "fp8-e4m3-scaled",
            Self::Bf16 => "bf16",
        };
        write!(f, "{name} ({} B rows)", self.row_bytes())
    }
}

/// How an indexer scale is chosen (block of 128 elements, one scale per token).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IndexerScale {
    /// Power-of-two `2^ceil(log2(max(amax, 1e-4) / 448))`, stored as f32 (the sharded path).
    Ue8m0,
    /// Plain `max(amax, 1e-4) / 448` (the unsharded fused store).
    Plain,
}

impl IndexerScale {
    pub(crate) const fn abi(self) -> u32 {
        match self {
            Self::Ue8m0 => crate::abi::KVS_SCALE_UE8M0,
            Self::Plain => crate::abi::KVS_SCALE_PLAIN,
        }
    }
}

/// Geometry of one pool (the target's L layers, or the draft's one layer) on one rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolGeometry {
    /// Latent row layout.
    pub latent: LatentLayout,
    /// Tokens per page; kvshard supports [`PAGE_SIZE`] only.
    pub page_size: usize,
    /// Indexer key elements per token; kvshard supports [`INDEXER_HEAD_DIM`] only.
    pub indexer_head_dim: usize,
    /// Elements per indexer scale; kvshard supports [`INDEXER_QUANT_BLOCK`] only.
    pub indexer_quant_block: usize,
    /// Per layer: whether it has its own indexer buffer. `false` marks a "shared indexer" layer
    /// (it reuses another layer's top-k): its indexer buffer has zero size and it is skipped
    /// by every transfer.
    pub indexer_layers: Vec<bool>,
}

impl PoolGeometry {
    /// A pool of `layers` layers, every one with its own indexer.
    pub fn new(latent: LatentLayout, layers: usize) -> Self {
        Self::with_indexer_layers(latent, vec![true; layers])
    }

    /// A pool whose layer `i` has an indexer exactly when `indexer_layers[i]`.
    pub fn with_indexer_layers(latent: LatentLayout, indexer_layers: Vec<bool>) -> Self {
        Self {
            latent,
            page_size: PAGE_SIZE,
            indexer_head_dim: INDEXER_HEAD_DIM,
            indexer_quant_block: INDEXER_QUANT_BLOCK,
            indexer_layers,
        }
    }

    /// The single-layer MTP draft pool matching this pool's layout.
    pub fn draft_of(&self) -> Self {
        Self::with_indexer_layers(self.latent, vec![true])
    }

    /// Layers in the pool.
    pub fn num_layers(&self) -> usize {
        self.indexer_layers.len()
    }

    /// Layers that have an indexer buffer, in layer order.
    pub fn indexer_layer_ids(&self) -> impl Iterator<Item = usize> + '_ {
        self.indexer_layers
            .iter()
            .enumerate()
            .filter_map(|(i, &has)| has.then_some(i))
    }

    /// Number of layers with an indexer buffer.
    pub fn num_indexer_layers(&self) -> usize {
        self.indexer_layers.iter().filter(|&&b| b).count()
    }

    /// Bytes of one latent row.
    pub fn row_bytes(&self) -> usize {
        self.latent.row_bytes()
    }

    /// Bytes of one (page, layer) latent block (saturating on geometries
    /// [`PoolGeometry::validate`] refuses).
    pub fn latent_block_bytes(&self) -> usize {
        self.row_bytes().saturating_mul(self.page_size)
    }

    /// Bytes of one (page, layer) indexer block (layers with an indexer). Saturates, and
    /// counts no scales for a quant block of 0, on geometries [`PoolGeometry::validate`] refuses.
    pub fn indexer_block_bytes(&self) -> usize {
        let scales = (4 * self.indexer_head_dim)
            .checked_div(self.indexer_quant_block)
            .unwrap_or(0);
        self.page_size
            .saturating_mul(self.indexer_head_dim.saturating_add(scales))
    }

    /// Bytes of one page across every layer and component of this pool (saturating; see
    /// [`PoolGeometry::page_bytes_checked`]).
    pub fn page_bytes(&self) -> usize {
        self.page_bytes_checked().unwrap_or(usize::MAX)
    }

    /// Bytes of one page across every layer and component of this pool, or an overflow.
    pub fn page_bytes_checked(&self) -> Result<usize> {
        let what = || format!("bytes of one page of {} layers", self.num_layers());
        let latent = self.num_layers().mul_or(self.latent_block_bytes(), what)?;
        let indexer = self
            .num_indexer_layers()
            .mul_or(self.indexer_block_bytes(), what)?;
        latent.add_or(indexer, what)
    }

    /// Checks this is a geometry kvshard's kernels support.
    pub fn validate(&self) -> Result<()> {
        if self.page_size != PAGE_SIZE {
            return Err(Error::InvalidGeometry(format!(
                "page size {} (kvshard supports {PAGE_SIZE})",
                self.page_size
            )));
        }
        if self.indexer_head_dim != INDEXER_HEAD_DIM
            || self.indexer_quant_block != INDEXER_QUANT_BLOCK
        {
            return Err(Error::InvalidGeometry(format!(
                "indexer head dim {} / quant block {} (kvshard supports {INDEXER_HEAD_DIM} / {INDEXER_QUANT_BLOCK})",
                self.indexer_head_dim, self.indexer_quant_block
            )));
        }
        if self.indexer_layers.is_empty() {
            return Err(Error::InvalidGeometry(
                "a pool needs at least one layer".into(),
            ));
        }
        Ok(())
    }

    /// Checks `other` stores pages the same way as `self` (row bytes, page size, indexer block),
    /// naming the first difference; `side` says which comparison this is. Nothing is formatted
    /// unless they differ: transfer plans check this on every chunk.
    fn validate_same_rows(&self, other: &PoolGeometry, side: &dyn Fn() -> String) -> Result<()> {
        let differ = |what: &str, expected: String, got: String| {
            Err(Error::GeometryMismatch {
                what: format!("{}: {what}", side()),
                expected,
                got,
            })
        };
        if self.latent != other.latent {
            return differ(
                "latent layout",
                self.latent.to_string(),
                other.latent.to_string(),
            );
        }
        let sizes = [
            ("page size", self.page_size, other.page_size),
            (
                "indexer head dim",
                self.indexer_head_dim,
                other.indexer_head_dim,
            ),
            (
                "indexer quant block",
                self.indexer_quant_block,
                other.indexer_quant_block,
            ),
        ];
        for (what, expected, got) in sizes {
            if expected != got {
                return differ(what, expected.to_string(), got.to_string());
            }
        }
        Ok(())
    }
}

/// The whole cache of one rank: the target pool and, with MTP, the single-layer draft pool.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CacheGeometry {
    /// Target model pool.
    pub target: PoolGeometry,
    /// Single-layer NextN/EAGLE draft pool, when the draft runs.
    pub draft: Option<PoolGeometry>,
}

impl CacheGeometry {
    /// A target-only cache.
    pub fn target_only(target: PoolGeometry) -> Self {
        Self {
            target,
            draft: None,
        }
    }

    /// A target cache with the matching single-layer draft.
    pub fn with_draft(target: PoolGeometry) -> Self {
        let draft = target.draft_of();
        Self {
            target,
            draft: Some(draft),
        }
    }

    /// Checks each pool is supported, and that the draft has one layer and the target's rows.
    pub fn validate(&self) -> Result<()> {
        self.target.validate()?;
        if let Some(draft) = &self.draft {
            draft.validate()?;
            if draft.num_layers() != 1 {
                return Err(Error::GeometryMismatch {
                    what: "draft layers".into(),
                    expected: "1".into(),
                    got: draft.num_layers().to_string(),
                });
            }
            self.target
                .validate_same_rows(draft, &|| "target vs draft".into())?;
        }
        Ok(())
    }

    /// Checks a prefill cache (`self`) and a decode cache agree on everything a transfer needs:
    /// rows, page size, indexer block, layer count, which layers have an indexer, and whether
    /// the draft is present on both sides.
    pub fn validate_pd(&self, decode: &CacheGeometry) -> Result<()> {
        self.validate()?;
        decode.validate()?;
        let pools = [
            ("target", Some(&self.target), Some(&decode.target)),
            ("draft", self.draft.as_ref(), decode.draft.as_ref()),
        ];
        for (name, prefill, dec) in pools {
            match (prefill, dec) {
                (None, None) => {}
                (Some(_), None) | (None, Some(_)) => {
                    return Err(Error::GeometryMismatch {
                        what: format!("prefill vs decode: {name} pool present"),
                        expected: prefill.is_some().to_string(),
                        got: dec.is_some().to_string(),
                    })
                }
                (Some(p), Some(d)) => {
                    p.validate_same_rows(d, &|| format!("prefill vs decode {name}"))?;
                    if p.num_layers() != d.num_layers() {
                        return Err(Error::GeometryMismatch {
                            what: format!("prefill vs decode {name}: layers"),
                            expected: p.num_layers().to_string(),
                            got: d.num_layers().to_string(),
                        });
                    }
                    if let Some(layer) =
                        (0..p.num_layers()).find(|&i| p.indexer_layers[i] != d.indexer_layers[i])
                    {
                        return Err(Error::GeometryMismatch {
                            what: format!(
                                "prefill vs decode {name}: indexer present in layer {layer}"
                            ),
                            expected: p.indexer_layers[layer].to_string(),
                            got: d.indexer_layers[layer].to_string(),
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// The pools of this cache, target first.
    pub fn pools(&self) -> impl Iterator<Item = &PoolGeometry> {
        std::iter::once(&self.target).chain(self.draft.as_ref())
    }

    /// Bytes of one page across target and draft, every layer and component (saturating; see
    /// [`CacheGeometry::page_bytes_checked`]).
    pub fn page_bytes(&self) -> usize {
        self.page_bytes_checked().unwrap_or(usize::MAX)
    }

    /// Bytes of one page across target and draft, every layer and component, or an overflow.
    pub fn page_bytes_checked(&self) -> Result<usize> {
        self.pools().try_fold(0usize, |sum, p| {
            sum.add_or(p.page_bytes_checked()?, || {
                "bytes of one page of the cache".into()
            })
        })
    }
}

/// The public DSA models kvshard is built for, as their `config.json`s describe them: every
/// target layer has its own indexer (index_head_dim 128), kv_lora_rank 512 + rope 64, and one
/// NextN (MTP) layer (`num_nextn_predict_layers: 1`), the draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Model {
    /// DeepSeek-V3.2 (`deepseek-ai/DeepSeek-V3.2-Exp`): 61 layers.
    DeepseekV32,
    /// GLM-5 (`zai-org/GLM-5`, `glm_moe_dsa`): 78 layers.
    Glm5,
}

impl Model {
    /// Target layers of the model.
    pub const fn layers(self) -> usize {
        match self {
            Self::DeepseekV32 => 61,
            Self::Glm5 => 78,
        }
    }

    /// The model's cache with rows of `latent`, and the MTP draft when `mtp`.
    pub fn geometry(self, latent: LatentLayout, mtp: bool) -> CacheGeometry {
        let target = PoolGeometry::new(latent, self.layers());
        if mtp {
            CacheGeometry::with_draft(target)
        } else {
            CacheGeometry::target_only(target)
        }
    }
}

impl fmt::Display for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::DeepseekV32 => "DeepSeek-V3.2",
            Self::Glm5 => "GLM-5",
        })
    }
}

/// One of the (up to) four byte arrays a rank's cache is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    /// Target model latent rows.
    TargetLatent,
    /// Target model indexer blocks (layers with their own indexer only).
    TargetIndexer,
    /// Draft (MTP) latent rows.
    DraftLatent,
    /// Draft indexer blocks.
    DraftIndexer,
}

impl Component {
    /// In the order kernels and transfers use: target latent, target indexer, draft latent,
    /// draft indexer.
    pub const ALL: [Component; 4] = [
        Self::TargetLatent,
        Self::TargetIndexer,
        Self::DraftLatent,
        Self::DraftIndexer,
    ];

    /// Whether this is an indexer component.
    pub fn is_indexer(self) -> bool {
        matches!(self, Self::TargetIndexer | Self::DraftIndexer)
    }

    /// Whether this belongs to the draft pool.
    pub fn is_draft(self) -> bool {
        matches!(self, Self::DraftLatent | Self::DraftIndexer)
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::TargetLatent => "target latent",
            Self::TargetIndexer => "target indexer",
            Self::DraftLatent => "draft latent",
            Self::DraftIndexer => "draft indexer",
        })
    }
}

/// How one component is laid out on one rank: `layers` buffers of `pages` blocks each.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ComponentLayout {
    /// Which component.
    pub component: Component,
    /// Model layer of each stored layer, in order: target layers are `0..L`, the draft layer is
    /// `L`; indexer components list only layers that have an indexer (zero-size ones are absent).
    pub model_layers: Vec<ModelLayer>,
    /// Bytes of one (page, layer) block.
    pub block_bytes: usize,
    /// Rows a block is made of when stored token by token (64 for latent rows, 1 for a
    /// page-major indexer block, which is never split by token).
    pub rows: usize,
    /// Bytes of one such row.
    pub row_bytes: usize,
}

impl ComponentLayout {
    /// Stored layers.
    pub fn layers(&self) -> usize {
        self.model_layers.len()
    }

    /// The stored layer holding model layer `layer`, or `None` when this component has none
    /// (a shared-indexer layer, or the other pool's layer).
    pub fn stored_layer(&self, layer: ModelLayer) -> Option<StoredLayer> {
        self.model_layers
            .iter()
            .position(|&m| m == layer)
            .map(StoredLayer)
    }

    /// The model layer stored layer `layer` holds, or `None` past the last one.
    pub fn model_layer(&self, layer: StoredLayer) -> Option<ModelLayer> {
        self.model_layers.get(layer.0).copied()
    }

    /// `layer`, checked against this component's stored layers.
    pub fn check_layer(&self, layer: StoredLayer) -> Result<StoredLayer> {
        if layer.0 >= self.layers() {
            return Err(Error::OutOfRange {
                what: "stored layer",
                index: i64::try_from(layer.0).unwrap_or(i64::MAX),
                limit: self.layers() as u64,
            });
        }
        Ok(layer)
    }

    /// Strides of a space storing this component packed: pages one block apart, rows back to back.
    pub fn packed_side(&self) -> crate::abi::kvs_block_side {
        crate::abi::kvs_block_side {
            page_stride: self.block_bytes as u64,
            row_stride: self.row_bytes as u64,
        }
    }

    /// Bytes of one page across this component's layers (saturating).
    pub fn page_bytes(&self) -> usize {
        self.layers().saturating_mul(self.block_bytes)
    }
}

impl CacheGeometry {
    /// The non-empty components of this cache, in [`Component::ALL`] order.
    pub fn components(&self) -> Vec<ComponentLayout> {
        let target_layers = self.target.num_layers();
        let latent =
            |component, pool: &PoolGeometry, model_layers: Vec<ModelLayer>| ComponentLayout {
                component,
                model_layers,
                block_bytes: pool.latent_block_bytes(),
                rows: pool.page_size,
                row_bytes: pool.row_bytes(),
            };
        let indexer =
            |component, pool: &PoolGeometry, model_layers: Vec<ModelLayer>| ComponentLayout {
                component,
                model_layers,
                block_bytes: pool.indexer_block_bytes(),
                rows: 1,
                row_bytes: pool.indexer_block_bytes(),
            };
        let mut out = vec![
            latent(
                Component::TargetLatent,
                &self.target,
                (0..target_layers).map(ModelLayer).collect(),
            ),
            indexer(
                Component::TargetIndexer,
                &self.target,
                self.target.indexer_layer_ids().map(ModelLayer).collect(),
            ),
        ];
        if let Some(draft) = &self.draft {
            let ids = |layers: Vec<usize>| {
                layers
                    .into_iter()
                    .map(|l| ModelLayer(target_layers + l))
                    .collect()
            };
            out.push(latent(
                Component::DraftLatent,
                draft,
                ids((0..draft.num_layers()).collect()),
            ));
            out.push(indexer(
                Component::DraftIndexer,
                draft,
                ids(draft.indexer_layer_ids().collect()),
            ));
        }
        out.retain(|c| c.layers() > 0);
        out
    }

    /// Model layers including the draft's (the index space of per-layer ready signals).
    pub fn model_layers(&self) -> usize {
        self.pools().map(PoolGeometry::num_layers).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_and_block_bytes_match_the_domain() {
        assert_eq!(LatentLayout::Fp8Trtllm.block_bytes(), 36_864);
        assert_eq!(LatentLayout::Fp8Scaled.block_bytes(), 41_984);
        assert_eq!(LatentLayout::Bf16.row_bytes(), 1152);
        let g = PoolGeometry::new(LatentLayout::Fp8Trtllm, 61);
        assert_eq!(g.indexer_block_bytes(), INDEXER_PAGE_BYTES);
        assert_eq!(INDEXER_PAGE_BYTES, 8448);
        assert_eq!(g.page_bytes(), 61 * (36_864 + 8448));
    }

    #[test]
    fn model_presets_have_their_layers_and_the_draft() {
        let g = Model::Glm5.geometry(LatentLayout::Fp8Trtllm, true);
        assert_eq!(g.model_layers(), 79);
        assert_eq!(g.page_bytes(), 79 * (36_864 + 8448));
        let g = Model::DeepseekV32.geometry(LatentLayout::Fp8Scaled, false);
        assert_eq!((g.target.num_indexer_layers(), g.draft), (61, None));
        assert_eq!(Model::DeepseekV32.to_string(), "DeepSeek-V3.2");
    }

    #[test]
    fn shared_indexer_layers_have_no_indexer_bytes() {
        let g = PoolGeometry::with_indexer_layers(
            LatentLayout::Fp8Trtllm,
            vec![true, false, true, false],
        );
        assert_eq!(g.indexer_layer_ids().collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(g.page_bytes(), 4 * 36_864 + 2 * 8448);
    }

    #[test]
    fn draft_must_match_target_rows_and_have_one_layer() {
        let target = PoolGeometry::new(LatentLayout::Fp8Trtllm, 3);
        assert!(CacheGeometry::with_draft(target.clone()).validate().is_ok());

        let mut two = CacheGeometry::with_draft(target.clone());
        two.draft = Some(PoolGeometry::new(LatentLayout::Fp8Trtllm, 2));
        let err = two.validate().unwrap_err().to_string();
        assert!(
            err.contains("draft layers") && err.contains("expected 1, got 2"),
            "{err}"
        );

        let mut other_rows = CacheGeometry::with_draft(target);
        other_rows.draft = Some(PoolGeometry::new(LatentLayout::Fp8Scaled, 1));
        let err = other_rows.validate().unwrap_err().to_string();
        assert!(err.contains("target vs draft: latent layout"), "{err}");
        assert!(err.contains("576") && err.contains("656"), "{err}");
    }

    #[test]
    fn unsupported_page_size_is_named() {
        let mut g = PoolGeometry::new(LatentLayout::Fp8Trtllm, 1);
        g.page_size = 32;
        assert!(g
            .validate()
            .unwrap_err()
            .to_string()
            .contains("page size 32"));
    }

    #[test]
    fn prefill_and_decode_must_agree() {
        let prefill = CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 4));
        assert!(prefill.validate_pd(&prefill.clone()).is_ok());

        let no_draft = CacheGeometry::target_only(prefill.target.clone());
        let err = prefill.validate_pd(&no_draft).unwrap_err().to_string();
        assert!(err.contains("draft pool present"), "{err}");

        let mut fewer = prefill.clone();
        fewer.target.indexer_layers.pop();
        let err = prefill.validate_pd(&fewer).unwrap_err().to_string();
        assert!(
            err.contains("target: layers") && err.contains("expected 4, got 3"),
            "{err}"
        );

        let mut shared = prefill.clone();
        shared.target.indexer_layers[2] = false;
        let err = prefill.validate_pd(&shared).unwrap_err().to_string();
        assert!(err.contains("indexer present in layer 2"), "{err}");

        let mut page = prefill.clone();
        page.target.page_size = 128;
        let err = prefill.validate_pd(&page).unwrap_err().to_string();
        assert!(err.contains("page size 128"), "{err}");
    }

    #[test]
    fn components_skip_empty_indexers_and_number_the_draft_after_the_target() {
        let target =
            PoolGeometry::with_indexer_layers(LatentLayout::Fp8Trtllm, vec![true, false, true]);
        let g = CacheGeometry::with_draft(target);
        let c = g.components();
        let names: Vec<_> = c.iter().map(|c| c.component).collect();
        assert_eq!(names, Component::ALL.to_vec());
        assert_eq!(c[0].model_layers, [0, 1, 2].map(ModelLayer));
        assert_eq!(c[1].model_layers, [0, 2].map(ModelLayer));
        assert_eq!(c[2].model_layers, [ModelLayer(3)]);
        assert_eq!(c[1].stored_layer(ModelLayer(2)), Some(StoredLayer(1)));
        assert_eq!(c[1].stored_layer(ModelLayer(1)), None);
        assert_eq!(c[2].model_layer(StoredLayer(0)), Some(ModelLayer(3)));
        assert_eq!((c[1].rows, c[1].row_bytes), (1, INDEXER_PAGE_BYTES));
        assert_eq!(g.model_layers(), 4);
        let all_shared = PoolGeometry::with_indexer_layers(LatentLayout::Fp8Trtllm, vec![false; 2]);
        assert_eq!(CacheGeometry::target_only(all_shared).components().len(), 1);
    }
}
