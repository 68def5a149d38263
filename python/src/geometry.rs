//! Geometry: latent layouts, components, pool and cache geometry, and the model presets.

use pyo3::prelude::*;

use kvshard::geometry::{
    CacheGeometry, Component, ComponentLayout, LatentLayout, Model, PoolGeometry,
};

use crate::errors::{invalid, IntoPy};

/// How a latent KV row is stored.
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    module = "kvshard",
    name = "LatentLayout"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyLatentLayout {
    /// FP8 E4M3 "trtllm": 512 e4m3 nope + 64 e4m3 rope, scale 1.0 (576-byte rows); the
    /// sharded DSA path.
    FP8_TRTLLM,
    /// FP8 E4M3 "scaled" (FlashMLA): 512 e4m3 nope, four f32 tile scales, 64 bf16 rope
    /// (656-byte rows); SGLang's FP8 DSA cache.
    FP8_SCALED,
    /// bf16 nope + rope (1,152-byte rows).
    BF16,
}

mirror_enum!(PyLatentLayout <=> LatentLayout {
    FP8_TRTLLM = Fp8Trtllm,
    FP8_SCALED = Fp8Scaled,
    BF16 = Bf16,
});

#[pymethods]
impl PyLatentLayout {
    /// Bytes of one token's row.
    #[getter]
    fn row_bytes(&self) -> usize {
        LatentLayout::from(*self).row_bytes()
    }

    /// Bytes of one (page, layer) block: 64 rows.
    #[getter]
    fn block_bytes(&self) -> usize {
        LatentLayout::from(*self).block_bytes()
    }
}

/// One of the (up to) four byte arrays a rank's cache is made of.
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    module = "kvshard",
    name = "Component"
)]
// Ordered as declared (kernel order), so per-component dicts list them in that order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyComponent {
    /// Target model latent rows.
    TARGET_LATENT,
    /// Target model indexer blocks (layers with their own indexer only).
    TARGET_INDEXER,
    /// Draft (MTP) latent rows.
    DRAFT_LATENT,
    /// Draft indexer blocks.
    DRAFT_INDEXER,
}

mirror_enum!(PyComponent <=> Component {
    TARGET_LATENT = TargetLatent,
    TARGET_INDEXER = TargetIndexer,
    DRAFT_LATENT = DraftLatent,
    DRAFT_INDEXER = DraftIndexer,
});

#[pymethods]
impl PyComponent {
    /// Whether this is an indexer component.
    #[getter]
    fn is_indexer(&self) -> bool {
        Component::from(*self).is_indexer()
    }

    /// Whether this belongs to the draft pool.
    #[getter]
    fn is_draft(&self) -> bool {
        Component::from(*self).is_draft()
    }

    fn __str__(&self) -> String {
        Component::from(*self).to_string()
    }
}

/// Geometry of one pool (the target's layers, or the draft's one layer) on one rank.
///
/// `PoolGeometry(latent, layers)` gives every layer an indexer; `indexer_layers=[...]` (one
/// bool per layer) marks shared-indexer layers (`False`: no indexer buffer, skipped by every
/// transfer).
#[pyclass(frozen, from_py_object, module = "kvshard", name = "PoolGeometry")]
#[derive(Clone)]
pub struct PyPoolGeometry(pub PoolGeometry);

#[pymethods]
impl PyPoolGeometry {
    #[new]
    #[pyo3(signature = (latent, layers = None, *, indexer_layers = None))]
    fn new(
        latent: PyLatentLayout,
        layers: Option<usize>,
        indexer_layers: Option<Vec<bool>>,
    ) -> PyResult<Self> {
        let latent = LatentLayout::from(latent);
        let g = match (layers, indexer_layers) {
            (Some(n), None) => PoolGeometry::new(latent, n),
            (None, Some(ix)) => PoolGeometry::with_indexer_layers(latent, ix),
            (Some(n), Some(ix)) if ix.len() == n => PoolGeometry::with_indexer_layers(latent, ix),
            _ => {
                return Err(invalid(
                    "give the layer count, or indexer_layers with one bool per layer",
                ))
            }
        };
        g.validate().py_err()?;
        Ok(Self(g))
    }

    /// Latent row layout.
    #[getter]
    fn latent(&self) -> PyLatentLayout {
        self.0.latent.into()
    }

    /// Layers in the pool.
    #[getter]
    fn num_layers(&self) -> usize {
        self.0.num_layers()
    }

    /// Per layer: whether it has its own indexer.
    #[getter]
    fn indexer_layers(&self) -> Vec<bool> {
        self.0.indexer_layers.clone()
    }

    /// Layers with an indexer buffer.
    #[getter]
    fn num_indexer_layers(&self) -> usize {
        self.0.num_indexer_layers()
    }

    /// Bytes of one latent row.
    #[getter]
    fn row_bytes(&self) -> usize {
        self.0.row_bytes()
    }

    /// Bytes of one (page, layer) latent block.
    #[getter]
    fn latent_block_bytes(&self) -> usize {
        self.0.latent_block_bytes()
    }

    /// Bytes of one (page, layer) indexer block (8,448).
    #[getter]
    fn indexer_block_bytes(&self) -> usize {
        self.0.indexer_block_bytes()
    }

    /// Bytes of one page across every layer and component of this pool.
    #[getter]
    fn page_bytes(&self) -> PyResult<usize> {
        self.0.page_bytes_checked().py_err()
    }

    /// The single-layer MTP draft pool matching this pool's layout.
    fn draft_of(&self) -> Self {
        Self(self.0.draft_of())
    }

    fn __eq__(&self, other: &Self) -> bool {
        self.0 == other.0
    }

    fn __repr__(&self) -> String {
        format!(
            "PoolGeometry({}, {} layers, {} with an indexer)",
            self.0.latent,
            self.0.num_layers(),
            self.0.num_indexer_layers()
        )
    }
}

/// The whole cache of one rank: the target pool and, with MTP, the single-layer draft pool.
///
/// `CacheGeometry(target, draft=True)` adds the matching draft; `draft=PoolGeometry(...)` a
/// given one; the presets `CacheGeometry.deepseek_v32()` and `CacheGeometry.glm5()` are the
/// public models.
#[pyclass(frozen, module = "kvshard", name = "CacheGeometry")]
#[derive(Clone)]
pub struct PyCacheGeometry(pub CacheGeometry);

impl PyCacheGeometry {
    fn preset(model: Model, latent: PyLatentLayout, draft: bool) -> Self {
        Self(model.geometry(latent.into(), draft))
    }
}

#[pymethods]
impl PyCacheGeometry {
    #[new]
    #[pyo3(signature = (target, draft = None))]
    fn new(target: PyPoolGeometry, draft: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let g = match draft {
            None => CacheGeometry::target_only(target.0),
            Some(d) if d.is_none() => CacheGeometry::target_only(target.0),
            Some(d) => match d.extract::<bool>() {
                Ok(true) => CacheGeometry::with_draft(target.0),
                Ok(false) => CacheGeometry::target_only(target.0),
                Err(_) => CacheGeometry {
                    target: target.0,
                    draft: Some(d.extract::<PyPoolGeometry>()?.0),
                },
            },
        };
        g.validate().py_err()?;
        Ok(Self(g))
    }

    /// DeepSeek-V3.2 (`deepseek-ai/DeepSeek-V3.2-Exp` config.json): 61 layers, every one with
    /// an indexer (index_head_dim 128), kv_lora_rank 512 + rope 64, and one NextN (MTP) layer
    /// (`num_nextn_predict_layers: 1`) as the draft unless `mtp=False`.
    #[staticmethod]
    #[pyo3(signature = (latent = PyLatentLayout::FP8_TRTLLM, mtp = true))]
    fn deepseek_v32(latent: PyLatentLayout, mtp: bool) -> Self {
        Self::preset(Model::DeepseekV32, latent, mtp)
    }

    /// GLM-5 (`zai-org/GLM-5` config.json, `glm_moe_dsa`): 78 layers, every one with a DSA
    /// indexer (index_head_dim 128), kv_lora_rank 512 + rope 64, and one NextN (MTP) layer as
    /// the draft unless `mtp=False`.
    #[staticmethod]
    #[pyo3(signature = (latent = PyLatentLayout::FP8_TRTLLM, mtp = true))]
    fn glm5(latent: PyLatentLayout, mtp: bool) -> Self {
        Self::preset(Model::Glm5, latent, mtp)
    }

    /// Target pool.
    #[getter]
    fn target(&self) -> PyPoolGeometry {
        PyPoolGeometry(self.0.target.clone())
    }

    /// Draft pool, when the draft runs.
    #[getter]
    fn draft(&self) -> Option<PyPoolGeometry> {
        self.0.draft.clone().map(PyPoolGeometry)
    }

    /// Model layers including the draft's (the index space of per-layer readiness).
    #[getter]
    fn model_layers(&self) -> usize {
        self.0.model_layers()
    }

    /// Bytes of one page across target and draft, every layer and component.
    #[getter]
    fn page_bytes(&self) -> PyResult<usize> {
        self.0.page_bytes_checked().py_err()
    }

    /// The non-empty components, in kernel order.
    fn components(&self) -> Vec<PyComponentLayout> {
        self.0
            .components()
            .into_iter()
            .map(PyComponentLayout)
            .collect()
    }

    /// Checks the geometry is one kvshard supports.
    fn validate(&self) -> PyResult<()> {
        self.0.validate().py_err()
    }

    /// Checks a prefill cache (self) and a decode cache agree on everything a transfer needs.
    fn validate_pd(&self, decode: &Self) -> PyResult<()> {
        self.0.validate_pd(&decode.0).py_err()
    }

    fn __eq__(&self, other: &Self) -> bool {
        self.0 == other.0
    }

    fn __repr__(&self) -> String {
        format!(
            "CacheGeometry({} target layers{}, {} B per page)",
            self.0.target.num_layers(),
            if self.0.draft.is_some() {
                " + MTP draft"
            } else {
                ""
            },
            self.0.page_bytes()
        )
    }
}

/// How one component is laid out on one rank: `layers` buffers of `pages` blocks each.
#[pyclass(frozen, module = "kvshard", name = "ComponentLayout")]
#[derive(Clone)]
pub struct PyComponentLayout(pub ComponentLayout);

#[pymethods]
impl PyComponentLayout {
    /// Which component.
    #[getter]
    fn component(&self) -> PyComponent {
        self.0.component.into()
    }

    /// Model layer of each stored layer.
    #[getter]
    fn model_layers(&self) -> Vec<usize> {
        self.0.model_layers.iter().map(|m| m.0).collect()
    }

    /// Stored layers.
    #[getter]
    fn layers(&self) -> usize {
        self.0.layers()
    }

    /// Bytes of one (page, layer) block.
    #[getter]
    fn block_bytes(&self) -> usize {
        self.0.block_bytes
    }

    /// Rows of a block (64 latent rows; 1 page-major indexer block).
    #[getter]
    fn rows(&self) -> usize {
        self.0.rows
    }

    /// Bytes of one row.
    #[getter]
    fn row_bytes(&self) -> usize {
        self.0.row_bytes
    }

    /// The stored layer holding model layer `layer`, or None.
    fn stored_layer(&self, layer: usize) -> Option<usize> {
        self.0
            .stored_layer(kvshard::index::ModelLayer(layer))
            .map(|s| s.0)
    }

    fn __repr__(&self) -> String {
        format!(
            "ComponentLayout({}, {} layers of {} B blocks)",
            self.0.component,
            self.0.layers(),
            self.0.block_bytes
        )
    }
}
