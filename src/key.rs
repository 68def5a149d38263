//! Storage keys that engines can share (docs/storage.md): `key = namespace || page
//! hash`, 64 bytes.
//!
//! - The **namespace** is SHA-256 over a canonical, versioned encoding of what makes two caches'
//!   bytes interchangeable: the model geometry (layers, which layers have an indexer, page size,
//!   indexer head and quant block), the row layout, the indexer scale format, whether a draft is
//!   present, kvshard's storage layout version ([`LAYOUT_VERSION`]) and a tenant tag. Two
//!   deployments that differ in any of these never see each other's pages.
//! - The **page hash** is SGLang's chain (`mem_cache/hicache_storage.py`, `get_hash_str`): for
//!   each full page of 64 tokens, `sha256()`, then `update(parent page hash)` when there is one,
//!   then `update(token.to_bytes(4, "little"))` for every token id; the digest is that page's hash
//!   and the parent of the next page. The same tokens give the same key in Rust, in Python and in
//!   SGLang, on every rank: the key holds no CP rank, because owners change when a prefix is
//!   reused in a new chain.
//!
//! # Canonical encoding of the namespace (version 1, integers little-endian)
//!
//! ```text
//! "kvshard-namespace" | u32 encoding version (1) | u32 layout version | pool(target)
//! | u8 draft present | [pool(draft)] | u8 indexer scale (0 ue8m0, 1 plain) | u32 tenant length | tenant
//! pool = u8 latent layout (0 fp8_trtllm, 1 fp8_scaled, 2 bf16) | u32 row bytes | u32 page size
//!      | u32 indexer head dim | u32 indexer quant block | u32 layers | u8 has indexer, per layer
//! ```

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::geometry::{CacheGeometry, IndexerScale, LatentLayout, PoolGeometry};

/// kvshard's storage layout version, part of every namespace: bumped whenever the bytes of a
/// stored page change meaning, so pages of an older layout are never read as this one's.
pub const LAYOUT_VERSION: u32 = 1;

/// Version of the namespace's own encoding (the module table).
const ENCODING_VERSION: u32 = 1;

/// Tokens of one hashed page (SGLang's page size for DSA models, kvshard's only one).
const PAGE_TOKENS: usize = crate::index::PAGE_SIZE;

/// Bytes of a SHA-256 digest.
pub const HASH_BYTES: usize = 32;

/// Bytes of a [`PageKey`].
pub const KEY_BYTES: usize = 2 * HASH_BYTES;

/// The namespace of a cache: SHA-256 over the canonical encoding in the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Namespace([u8; HASH_BYTES]);

impl Namespace {
    /// The namespace of caches of `geometry` whose indexer scales are `scale`, for tenant
    /// `tenant` (any bytes; empty for a deployment with one tenant). The geometry is validated
    /// first: a namespace names only caches kvshard can hold.
    pub fn new(geometry: &CacheGeometry, scale: IndexerScale, tenant: &[u8]) -> Result<Self> {
        geometry.validate()?;
        let tenant_len = u32::try_from(tenant.len())
            .map_err(|_| Error::InvalidArgument(format!("tenant tag of {} B", tenant.len())))?;
        let mut h = Sha256::new();
        h.update(b"kvshard-namespace");
        h.update(ENCODING_VERSION.to_le_bytes());
        h.update(LAYOUT_VERSION.to_le_bytes());
        pool(&mut h, &geometry.target)?;
        h.update([u8::from(geometry.draft.is_some())]);
        if let Some(draft) = &geometry.draft {
            pool(&mut h, draft)?;
        }
        h.update([match scale {
            IndexerScale::Ue8m0 => 0u8,
            IndexerScale::Plain => 1,
        }]);
        h.update(tenant_len.to_le_bytes());
        h.update(tenant);
        Ok(Self(h.finalize().into()))
    }

    /// The 32 bytes.
    pub fn bytes(&self) -> &[u8; HASH_BYTES] {
        &self.0
    }
}

fn pool(h: &mut Sha256, p: &PoolGeometry) -> Result<()> {
    let u32_of = |what: &str, v: usize| {
        u32::try_from(v).map_err(|_| Error::InvalidGeometry(format!("{what} {v} exceeds u32")))
    };
    h.update([match p.latent {
        LatentLayout::Fp8Trtllm => 0u8,
        LatentLayout::Fp8Scaled => 1,
        LatentLayout::Bf16 => 2,
    }]);
    for (what, v) in [
        ("row bytes", p.row_bytes()),
        ("page size", p.page_size),
        ("indexer head dim", p.indexer_head_dim),
        ("indexer quant block", p.indexer_quant_block),
        ("layers", p.num_layers()),
    ] {
        h.update(u32_of(what, v)?.to_le_bytes());
    }
    h.update(
        p.indexer_layers
            .iter()
            .map(|&has| u8::from(has))
            .collect::<Vec<_>>(),
    );
    Ok(())
}

/// The hash of one full page of tokens in SGLang's chain (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageHash(pub [u8; HASH_BYTES]);

impl PageHash {
    /// The hash of the page `tokens` (exactly 64 token ids) whose parent page hashed to
    /// `prior` (`None` for the first page of a sequence).
    pub fn of(tokens: &[u32], prior: Option<&PageHash>) -> Result<Self> {
        if tokens.len() != PAGE_TOKENS {
            return Err(Error::MisalignedPrefix {
                tokens: tokens.len(),
                page_size: PAGE_TOKENS,
            });
        }
        let mut h = Sha256::new();
        if let Some(prior) = prior {
            h.update(prior.0);
        }
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        Ok(Self(h.finalize().into()))
    }

    /// The hashes of every full page of `tokens`, chained from `prior`: a trailing partial page
    /// has no hash (it is never stored).
    pub fn chain(tokens: &[u32], prior: Option<&PageHash>) -> Vec<PageHash> {
        let mut out: Vec<PageHash> = Vec::with_capacity(tokens.len() / PAGE_TOKENS);
        for page in tokens.chunks_exact(PAGE_TOKENS) {
            let parent = out.last().or(prior);
            // Every chunk is one full page: `of` accepts it.
            if let Ok(h) = Self::of(page, parent) {
                out.push(h);
            }
        }
        out
    }

    /// The lowercase hex digest, as SGLang prints it.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A page's storage key: `namespace || page hash`, 64 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageKey([u8; KEY_BYTES]);

impl PageKey {
    /// The key of page `hash` in `namespace`.
    pub fn new(namespace: &Namespace, hash: &PageHash) -> Self {
        let mut k = [0u8; KEY_BYTES];
        k[..HASH_BYTES].copy_from_slice(&namespace.0);
        k[HASH_BYTES..].copy_from_slice(&hash.0);
        Self(k)
    }

    /// The keys of every full page of `tokens` in `namespace`, chained from `prior`.
    pub fn chain(namespace: &Namespace, tokens: &[u32], prior: Option<&PageHash>) -> Vec<Self> {
        PageHash::chain(tokens, prior)
            .iter()
            .map(|h| Self::new(namespace, h))
            .collect()
    }

    /// A key from its 64 bytes (as an engine or the Python binding holds it).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let k: [u8; KEY_BYTES] = bytes.try_into().map_err(|_| {
            Error::InvalidArgument(format!(
                "a storage key has {KEY_BYTES} bytes, got {}",
                bytes.len()
            ))
        })?;
        Ok(Self(k))
    }

    /// The 64 bytes.
    pub fn bytes(&self) -> &[u8; KEY_BYTES] {
        &self.0
    }

    /// The lowercase hex of the 64 bytes.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

#[cfg(test)]
mod tests {
    //! Every expected digest below was computed independently with Python's `hashlib` when the
    //! test was written (the script is the one in each comment), not by this module.
    use super::*;

    fn from_hex(s: &str) -> [u8; 32] {
        let mut out = [0u8; 32];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
        }
        out
    }

    /// Page 0: tokens 0..64; page 1: `(i * 2654435761) % 2**32` for i in 64..128.
    fn pages() -> (Vec<u32>, Vec<u32>) {
        let p0: Vec<u32> = (0..64).collect();
        let p1: Vec<u32> = (64u64..128)
            .map(|i| ((i * 2_654_435_761) % (1 << 32)) as u32)
            .collect();
        (p0, p1)
    }

    #[test]
    fn page_hashes_are_sglangs_chain() {
        // h = sha256(); [h.update(bytes.fromhex(prior))]; h.update(t.to_bytes(4, "little")) ...
        let (p0, p1) = pages();
        assert_eq!(p1[..3], [2380164160, 739632625, 3394068386]);
        let a = PageHash::of(&p0, None).unwrap();
        assert_eq!(
            a.to_hex(),
            "fea7b32778ecbdd7adee1941e98c89cf96bbc762f5f1beb0be24e36a456fbbc5"
        );
        let b = PageHash::of(&p1, Some(&a)).unwrap();
        assert_eq!(
            b.to_hex(),
            "4a38d11a70d23c72b30e338deb1affe79fcd1fbfe2aa62a4166bee05721a346f"
        );
        // The two-page chain in one call, a trailing partial page ignored.
        let mut tokens = [p0.clone(), p1.clone()].concat();
        tokens.extend([7, 8, 9]);
        assert_eq!(PageHash::chain(&tokens, None), vec![a, b]);
        // A prior hash: hashlib.sha256(b"parent").hexdigest() seeds page 0.
        let prior = PageHash(from_hex(
            "e47125968b3b71049fbc4802d1e40a71ea1359decfabacf70b34588037d4ff0c",
        ));
        assert_eq!(
            PageHash::of(&p0, Some(&prior)).unwrap().to_hex(),
            "e1464ee8742d251f5b28a87c984944727de5c8b0c164804c1a5fb3d6cfd2b862"
        );
        assert!(PageHash::chain(&p0[..63], None).is_empty());
        assert!(matches!(
            PageHash::of(&p0[..63], None),
            Err(Error::MisalignedPrefix { tokens: 63, .. })
        ));
    }

    #[test]
    fn namespaces_follow_the_canonical_encoding() {
        // The encoding of the module docs, in Python with struct.pack('<BIIIII', ...) per pool.
        let g = CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
            LatentLayout::Fp8Trtllm,
            vec![true, false, true],
        ));
        let ns = Namespace::new(&g, IndexerScale::Ue8m0, b"acme").unwrap();
        assert_eq!(
            hex(ns.bytes()),
            "07f01645505c575203feee3e62767b2c2d6c0f1891df944f61468431ecd313c4"
        );
        let target = CacheGeometry::target_only(g.target.clone());
        let plain = Namespace::new(&target, IndexerScale::Ue8m0, b"").unwrap();
        assert_eq!(
            hex(plain.bytes()),
            "1f3b22b3794bf61bd3f18c8a87cd6dd30dcb754f8d767c87f70dc70bfebd2699"
        );
        // Every input moves the namespace.
        let others = [
            Namespace::new(&g, IndexerScale::Plain, b"acme").unwrap(),
            Namespace::new(&g, IndexerScale::Ue8m0, b"acme2").unwrap(),
            Namespace::new(
                &CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
                    LatentLayout::Fp8Scaled,
                    vec![true, false, true],
                )),
                IndexerScale::Ue8m0,
                b"acme",
            )
            .unwrap(),
            Namespace::new(
                &CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 3)),
                IndexerScale::Ue8m0,
                b"acme",
            )
            .unwrap(),
        ];
        for o in others.iter().chain([&plain]) {
            assert_ne!(o, &ns);
        }
        let mut bad = g.clone();
        bad.target.page_size = 32;
        assert!(Namespace::new(&bad, IndexerScale::Ue8m0, b"").is_err());
    }

    #[test]
    fn keys_are_namespace_then_hash() {
        let g = CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 2));
        let ns = Namespace::new(&g, IndexerScale::Ue8m0, b"").unwrap();
        let (p0, p1) = pages();
        let keys = PageKey::chain(&ns, &[p0, p1].concat(), None);
        assert_eq!(keys.len(), 2);
        assert_eq!(&keys[0].bytes()[..32], ns.bytes());
        assert_eq!(
            hex(&keys[1].bytes()[32..]),
            "4a38d11a70d23c72b30e338deb1affe79fcd1fbfe2aa62a4166bee05721a346f"
        );
        assert_eq!(PageKey::from_bytes(keys[1].bytes()).unwrap(), keys[1]);
        assert!(PageKey::from_bytes(&[0; 63]).is_err());
    }
}
