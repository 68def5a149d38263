//! Decode context parallelism (docs/dcp.md): how a decode server sharded by token places a
//! request (`DecodeLayout`, with vLLM's and SGLang's names for its parameters) and what its
//! ranks register for one request (`DecodeRank`, `DecodeRegistration`). Below `transfer`, which
//! sends into them (`Sender.open_decode`) and receives their shares
//! (`Receiver.register_decode`).

use pyo3::prelude::*;

use kvshard::index::LocalPage;
use kvshard::shard::DecodeLayout;
use kvshard::transfer::{DecodeRank, DecodeRegistration, PoolLayout};

use crate::device_pool::PyDevicePool;
use crate::errors::IntoPy;
use crate::geometry::PyCacheGeometry;

/// How a decode server shards a request's KV cache by token: over `ranks` ranks (M),
/// `interleave` tokens (I) at a time. Token `t` lives on rank `(t // I) % M` as that rank's
/// local token `(t // (I * M)) * I + t % I`, in row `k % 64` of the rank's `k // 64`-th page of
/// the request. vLLM: `decode_context_parallel_size` ranks, `cp_kv_cache_interleave_size`
/// tokens (`DecodeLayout.vllm`); SGLang's DSA DCP: `dcp_size` ranks, one token at a time
/// (`DecodeLayout.sglang`); TensorRT-LLM Helix: a block (a page) at a time; `ranks=1`: the
/// unsharded decode.
#[pyclass(
    frozen,
    eq,
    hash,
    from_py_object,
    module = "kvshard",
    name = "DecodeLayout"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyDecodeLayout(pub DecodeLayout);

#[pymethods]
impl PyDecodeLayout {
    /// `ranks` decode ranks (1 to 1024) taking `interleave` consecutive tokens each in turn.
    #[new]
    #[pyo3(signature = (ranks = 1, interleave = 1))]
    fn new(ranks: u32, interleave: u32) -> PyResult<Self> {
        Ok(Self(DecodeLayout::new(ranks, interleave).py_err()?))
    }

    /// vLLM's decode context parallelism: `--decode-context-parallel-size` (`-dcp`) ranks,
    /// `--cp-kv-cache-interleave-size` tokens at a time (1 by default; the block size for
    /// P/D).
    #[staticmethod]
    #[pyo3(signature = (decode_context_parallel_size, cp_kv_cache_interleave_size = 1))]
    fn vllm(decode_context_parallel_size: u32, cp_kv_cache_interleave_size: u32) -> PyResult<Self> {
        Self::new(decode_context_parallel_size, cp_kv_cache_interleave_size)
    }

    /// SGLang's decode context parallelism: `--dcp-size` (`--decode-context-parallel-size`)
    /// ranks, token `t` on rank `t % dcp_size`.
    #[staticmethod]
    fn sglang(dcp_size: u32) -> PyResult<Self> {
        Self::new(dcp_size, 1)
    }

    /// The unsharded decode: one rank holding every token.
    #[staticmethod]
    fn unsharded() -> Self {
        Self(DecodeLayout::unsharded())
    }

    /// Decode ranks (M).
    #[getter]
    fn ranks(&self) -> u32 {
        self.0.ranks()
    }

    /// Consecutive tokens one rank takes before the next rank's turn (I).
    #[getter]
    fn interleave(&self) -> u32 {
        self.0.interleave()
    }

    /// The ranks under vLLM's name.
    #[getter]
    fn decode_context_parallel_size(&self) -> u32 {
        self.0.ranks()
    }

    /// The interleave under vLLM's name.
    #[getter]
    fn cp_kv_cache_interleave_size(&self) -> u32 {
        self.0.interleave()
    }

    /// The ranks under SGLang's name.
    #[getter]
    fn dcp_size(&self) -> u32 {
        self.0.ranks()
    }

    /// Whether every page of the sequence lands whole on one rank (one rank, or an interleave
    /// of whole pages).
    #[getter]
    fn page_granular(&self) -> bool {
        self.0.is_page_granular()
    }

    /// `(rank, local)`: the decode rank token `token` lives on, and its local token there.
    fn place(&self, token: u64) -> (u32, u64) {
        let at = self.0.place(token);
        (at.rank, at.local)
    }

    /// The token living on `rank` as its local token `local` (None outside the layout).
    fn token(&self, rank: u32, local: u64) -> Option<u64> {
        self.0.token(rank, local)
    }

    /// How many of tokens `0..tokens` live on `rank`.
    fn tokens_on(&self, rank: u32, tokens: u64) -> u64 {
        self.0.tokens_on(rank, tokens)
    }

    /// Pages `rank` holds of a request of `tokens` tokens: how many it registers.
    fn pages_on(&self, rank: u32, tokens: u64) -> u64 {
        self.0.pages_on(rank, tokens)
    }

    fn __repr__(&self) -> String {
        format!(
            "DecodeLayout(ranks={}, interleave={})",
            self.0.ranks(),
            self.0.interleave()
        )
    }
}

fn pages(ids: Vec<u64>) -> Vec<LocalPage> {
    ids.into_iter().map(LocalPage).collect()
}

fn ids(pages: &[LocalPage]) -> Vec<u64> {
    pages.iter().map(|p| p.0).collect()
}

/// One decode rank's part of a `DecodeRegistration`: its pool (`geometry`, `pool_pages` pages
/// per layer, packed as every `DevicePool`; `DecodeRank.of(pool, ...)` takes them from one),
/// and the page holding each of its local pages of the request, from its first
/// (`DecodeLayout.pages_on` of them), for the latent rows (`pages`) and the indexer state
/// (`state_pages`: default the same pages when the cache has an indexer, none otherwise).
#[pyclass(frozen, from_py_object, module = "kvshard", name = "DecodeRank")]
#[derive(Clone)]
pub struct PyDecodeRank(pub DecodeRank);

impl PyDecodeRank {
    fn of_layout(layout: PoolLayout, pages: Vec<u64>, state_pages: Option<Vec<u64>>) -> Self {
        let indexer = layout
            .geometry
            .components()
            .iter()
            .any(|c| c.component.is_indexer());
        let state_pages = match state_pages {
            Some(s) => s,
            None if indexer => pages.clone(),
            None => Vec::new(),
        };
        Self(DecodeRank {
            layout,
            pages: self::pages(pages),
            state_pages: self::pages(state_pages),
        })
    }
}

#[pymethods]
impl PyDecodeRank {
    #[new]
    #[pyo3(signature = (geometry, pool_pages, pages, state_pages = None))]
    fn new(
        geometry: &PyCacheGeometry,
        pool_pages: u64,
        pages: Vec<u64>,
        state_pages: Option<Vec<u64>>,
    ) -> Self {
        Self::of_layout(
            PoolLayout::packed(geometry.0.clone(), pool_pages),
            pages,
            state_pages,
        )
    }

    /// The part of the rank whose pool is `pool`.
    #[staticmethod]
    #[pyo3(signature = (pool, pages, state_pages = None))]
    fn of(pool: &PyDevicePool, pages: Vec<u64>, state_pages: Option<Vec<u64>>) -> Self {
        Self::of_layout(PoolLayout::of(&pool.inner), pages, state_pages)
    }

    /// Geometry of the rank's cache.
    #[getter]
    fn geometry(&self) -> PyCacheGeometry {
        PyCacheGeometry(self.0.layout.geometry.clone())
    }

    /// Pages per layer of the rank's pool.
    #[getter]
    fn pool_pages(&self) -> u64 {
        self.0.layout.pages
    }

    /// Page of each local page, for the latent rows.
    #[getter]
    fn pages(&self) -> Vec<u64> {
        ids(&self.0.pages)
    }

    /// Page of each local page, for the indexer state.
    #[getter]
    fn state_pages(&self) -> Vec<u64> {
        ids(&self.0.state_pages)
    }
}

/// What the ranks of a decode server sharded by token registered for one request (sent to
/// every prefill rank, opened with `Sender.open_decode`): the `DecodeLayout`, the request's
/// `tokens`, the decode ranks' cached `prefix_pages` (sequence pages, never sent) and every
/// rank's pages. Checked when made. Decode rank `d`'s `Receiver` registers its share with
/// `Receiver.register_decode(registration, d, prefill_ranks)`.
#[pyclass(frozen, module = "kvshard", name = "DecodeRegistration")]
#[derive(Clone)]
pub struct PyDecodeRegistration(pub DecodeRegistration);

#[pymethods]
impl PyDecodeRegistration {
    #[new]
    #[pyo3(signature = (request, layout, tokens, ranks, prefix_pages = 0))]
    fn new(
        request: u64,
        layout: &PyDecodeLayout,
        tokens: usize,
        ranks: Vec<PyDecodeRank>,
        prefix_pages: usize,
    ) -> PyResult<Self> {
        let r = DecodeRegistration {
            request,
            layout: layout.0,
            tokens,
            prefix_pages,
            ranks: ranks.into_iter().map(|r| r.0).collect(),
        };
        r.validate().py_err()?;
        Ok(Self(r))
    }

    /// Request id.
    #[getter]
    fn request(&self) -> u64 {
        self.0.request
    }

    /// How the decode server shards the request.
    #[getter]
    fn layout(&self) -> PyDecodeLayout {
        PyDecodeLayout(self.0.layout)
    }

    /// Tokens of the request's sequence.
    #[getter]
    fn tokens(&self) -> usize {
        self.0.tokens
    }

    /// Leading sequence pages the decode ranks already hold.
    #[getter]
    fn prefix_pages(&self) -> usize {
        self.0.prefix_pages
    }

    /// Every decode rank's part, in rank order.
    #[getter]
    fn ranks(&self) -> Vec<PyDecodeRank> {
        self.0.ranks.iter().cloned().map(PyDecodeRank).collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "DecodeRegistration(request={}, {}, tokens={}, prefix_pages={})",
            self.0.request, self.0.layout, self.0.tokens, self.0.prefix_pages
        )
    }
}
