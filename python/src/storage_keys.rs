//! Storage keys engines can share (kvshard's `key` module): the `Namespace` of a cache, SGLang's
//! page-hash chain over token ids, and the 64-byte keys `namespace || page hash` the storage
//! tier (`DiskStore`) is addressed by. Built without NIXL too: keys need no I/O.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use kvshard::geometry::IndexerScale;
use kvshard::key::{Namespace, PageHash, PageKey, HASH_BYTES};

use crate::errors::{invalid, IntoPy};
use crate::geometry::PyCacheGeometry;

/// How the cache's indexer scales were computed: part of the namespace, because the same
/// tokens give other indexer bytes under the other rule.
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    module = "kvshard",
    name = "IndexerScale"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum PyIndexerScale {
    /// Power-of-two scales stored as f32 (the sharded path, kvshard's own kernels).
    UE8M0,
    /// Plain `amax / 448` scales (SGLang's unsharded fused store).
    PLAIN,
}

mirror_enum!(PyIndexerScale <=> IndexerScale {
    UE8M0 = Ue8m0,
    PLAIN = Plain,
});

/// Token ids as SGLang hashes them: each a 4-byte little-endian unsigned integer. A negative id
/// or one above 2**32 - 1 has no such encoding and is refused.
fn tokens_of(tokens: Vec<i64>) -> PyResult<Vec<u32>> {
    tokens
        .into_iter()
        .map(|t| {
            u32::try_from(t).map_err(|_| {
                invalid(format!(
                    "token id {t} is not a 4-byte unsigned integer (SGLang's page hash encoding)"
                ))
            })
        })
        .collect()
}

/// A page hash from SGLang's hex string (64 hex digits, as `get_hash_str` returns it) or its
/// 32 bytes.
pub fn page_hash_of(hash: &Bound<'_, PyAny>) -> PyResult<PageHash> {
    if let Ok(b) = hash.cast::<PyBytes>() {
        let bytes: [u8; HASH_BYTES] = b.as_bytes().try_into().map_err(|_| {
            invalid(format!(
                "a page hash has {HASH_BYTES} bytes, got {}",
                b.as_bytes().len()
            ))
        })?;
        return Ok(PageHash(bytes));
    }
    let s: String = hash
        .extract()
        .map_err(|_| invalid("a page hash is a hex string (SGLang's get_hash_str) or 32 bytes"))?;
    parse_hex(&s).ok_or_else(|| {
        invalid(format!(
            "page hash {s:?}: expected {} hex digits (SGLang's sha256 get_hash_str)",
            2 * HASH_BYTES
        ))
    })
}

/// The hash of a 64-hex-digit string, or None.
pub fn parse_hex(s: &str) -> Option<PageHash> {
    if s.len() != 2 * HASH_BYTES || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; HASH_BYTES];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(PageHash(out))
}

/// The hash of one page of exactly 64 token ids in SGLang's chain (its `get_hash_str`):
/// SHA-256 over the parent page's hash (`prior_hash`, hex, when there is one), then each token
/// id as 4 little-endian bytes. Returns the lowercase hex digest.
#[pyfunction]
#[pyo3(signature = (token_ids, prior_hash = None))]
pub fn page_hash(token_ids: Vec<i64>, prior_hash: Option<&Bound<'_, PyAny>>) -> PyResult<String> {
    let tokens = tokens_of(token_ids)?;
    let prior = prior_hash.map(page_hash_of).transpose()?;
    Ok(PageHash::of(&tokens, prior.as_ref()).py_err()?.to_hex())
}

/// The hashes (hex) of every full page of `token_ids`, chained from `prior_hash`: page `i`'s
/// parent is page `i - 1` (SGLang's prefix hashing). A trailing partial page has none.
#[pyfunction]
#[pyo3(signature = (token_ids, prior_hash = None))]
pub fn page_hashes(
    token_ids: Vec<i64>,
    prior_hash: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<String>> {
    let tokens = tokens_of(token_ids)?;
    let prior = prior_hash.map(page_hash_of).transpose()?;
    Ok(PageHash::chain(&tokens, prior.as_ref())
        .iter()
        .map(PageHash::to_hex)
        .collect())
}

/// The namespace of a cache: SHA-256 over what makes two caches' bytes interchangeable (the
/// geometry, row layout, indexer scale rule, draft, kvshard's storage layout version) and a
/// tenant tag. `Namespace(geometry, tenant=b"", scale=IndexerScale.UE8M0)`; `key(hash)` is the
/// 64-byte storage key of a page hash (SGLang's hex string, or 32 bytes).
#[pyclass(frozen, module = "kvshard", name = "Namespace")]
pub struct PyNamespace(pub Namespace);

#[pymethods]
impl PyNamespace {
    #[new]
    #[pyo3(signature = (geometry, tenant = Vec::new(), scale = PyIndexerScale::UE8M0))]
    fn new(geometry: &PyCacheGeometry, tenant: Vec<u8>, scale: PyIndexerScale) -> PyResult<Self> {
        Ok(Self(
            Namespace::new(&geometry.0, scale.into(), &tenant).py_err()?,
        ))
    }

    /// The 32 bytes.
    #[getter]
    fn bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.0.bytes())
    }

    /// The 64-byte key of page `hash` (hex string or 32 bytes) in this namespace.
    fn key<'py>(&self, py: Python<'py>, hash: &Bound<'_, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        let k = PageKey::new(&self.0, &page_hash_of(hash)?);
        Ok(PyBytes::new(py, k.bytes()))
    }

    /// The keys of `hashes`, in order.
    fn keys<'py>(
        &self,
        py: Python<'py>,
        hashes: Vec<Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        hashes.iter().map(|h| self.key(py, h)).collect()
    }

    /// The keys of every full page of `token_ids`, chained from `prior_hash`.
    #[pyo3(signature = (token_ids, prior_hash = None))]
    fn chain_keys<'py>(
        &self,
        py: Python<'py>,
        token_ids: Vec<i64>,
        prior_hash: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let tokens = tokens_of(token_ids)?;
        let prior = prior_hash.map(page_hash_of).transpose()?;
        Ok(PageKey::chain(&self.0, &tokens, prior.as_ref())
            .iter()
            .map(|k| PyBytes::new(py, k.bytes()))
            .collect())
    }

    fn __eq__(&self, other: &Self) -> bool {
        self.0 == other.0
    }

    fn __repr__(&self) -> String {
        let hex: String = self.0.bytes().iter().map(|b| format!("{b:02x}")).collect();
        format!("Namespace({hex})")
    }
}
