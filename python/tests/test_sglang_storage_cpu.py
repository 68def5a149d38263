"""SGLang's storage interface (``kvshard.sglang_storage.KvshardStorage``) on the CPU: opened the
way SGLang's ``dynamic`` storage backend opens it, over a ``kvshard.sglang.MLAHostPool`` with
every component (latent, packed MTP draft, indexer keys and scales), on NIXL's POSIX backend
against a directory under the build tree. Random pages stored and reloaded into other host
pages byte for byte, prefix semantics of exists, the v2 calls with the kv, indexer and draft
pools, misses, a slot with flipped bytes reported as a miss and counted, a second TP rank
reading rank 0's pages (SGLang's MLA rule: only TP rank 0 writes), SGLang's own host pools
(stand-ins with its attributes and buffer shapes) adopted without a copy, a DSA pool without its
indexer pool never stored, typed storage errors, and the page-hash chain against hashlib's
computation of SGLang's ``get_hash_str``.

Which base class it ran against is reported (a warning in pytest's summary): SGLang's own
``HiCacheStorage`` when the ``sglang`` wheel imports, else the module's stand-in with the same
signatures. It needs the NIXL runtime (``scripts/install-nixl.sh`` on LD_LIBRARY_PATH) and a
wheel built with the ``nixl`` feature: without them it skips, or fails when
``KVSHARD_REQUIRE_NIXL`` is set (CI sets it)."""

import functools
import hashlib
import importlib
import os
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import kvshard
from kvshard.error import HiCacheError, InvalidArgumentError, StorageError, UnavailableError
from kvshard.geometry import CacheGeometry, LatentLayout, PoolGeometry
from kvshard.storage import IndexerScale, KEY_BYTES, Namespace, page_hash, page_hashes
from conftest import PAGE
from kvshard import sglang_storage
from kvshard.sglang import MLAHostPool
from kvshard.sglang_storage import (
    BASE_CLASS,
    HiCacheStorage,
    HiCacheStorageConfig,
    KvshardStorage,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

POISON = 0xA5
PAGES = 12  # host pages, page 0 the padding page


def geometry():
    return CacheGeometry(
        PoolGeometry(LatentLayout.FP8_SCALED, indexer_layers=[True, False, True]), draft=True
    )


def scratch_base():
    """Where the tests' stores go: under the build tree (a real filesystem: tmpfs may refuse
    O_DIRECT), else $TMPDIR."""
    target = Path(__file__).resolve().parents[2] / "target"
    return target if target.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


@functools.cache
def nixl_runtime_missing():
    """Why NIXL's runtime does not load here (None when it does): a one-slot DiskStore opened in
    a scratch directory. Without the runtime the backend opens its store at the first storage
    call and reports misses, so a test would fail on its hits instead of skipping."""
    d = scratch_base() / "storage-tests-py" / "nixl-probe"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    try:
        kvshard.storage.DiskStore(host_pool().host, d / "s", 1)
    except UnavailableError as e:
        return str(e)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return None


def need_nixl(what):
    """Skips (or fails, with KVSHARD_REQUIRE_NIXL) without the storage tier: a wheel built
    without it, or NIXL's runtime not loading."""
    if not hasattr(kvshard.storage, "DiskStore"):
        msg = f"{what}: this wheel has no storage tier (built without --features nixl)"
    elif (missing := nixl_runtime_missing()) is not None:
        msg = f"{what}: NIXL runtime missing: {missing}"
    else:
        return
    if os.environ.get("KVSHARD_REQUIRE_NIXL"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture
def store_dir(request):
    """A fresh directory under the build tree (a real filesystem: tmpfs may refuse O_DIRECT)."""
    d = scratch_base() / "storage-tests-py" / request.node.name.replace("[", "-").replace("]", "")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def config(store_dir, tp_rank=0, tp_size=1, **extra):
    """A config with HiCacheStorageConfig's fields, as SGLang's scheduler fills it, and the
    dynamic backend's extra_config."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=True,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="test/dsa",
        extra_config={
            "backend_name": "kvshard",
            "module_path": "kvshard.sglang_storage",
            "class_name": "KvshardStorage",
            "dir": str(store_dir),
            "slots": 16,
            "tenant": "test",
            **extra,
        },
    )


def create_backend(storage_config):
    """What SGLang's StorageBackendFactory does for ``--hicache-storage-backend dynamic``: its
    own code where sglang imports, else the same steps (import ``module_path``, take
    ``class_name``, check it subclasses HiCacheStorage, call it with ``(storage_config,
    kwargs)``)."""
    if BASE_CLASS == "sglang":
        factory = importlib.import_module("sglang.srt.mem_cache.storage.backend_factory")
        return factory.StorageBackendFactory.create_backend("dynamic", storage_config, None)
    extra = storage_config.extra_config
    cls = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
    assert issubclass(cls, HiCacheStorage)
    return cls(storage_config, {})


def open_backend(storage_config, host):
    """The backend, with its host pool registered as SGLang's controller registers it."""
    need_nixl("KvshardStorage")
    try:
        backend = create_backend(storage_config)
        backend.register_mem_pool_host(host)
    except UnavailableError as e:
        if os.environ.get("KVSHARD_REQUIRE_NIXL"):
            raise
        pytest.skip(f"NIXL runtime missing: {e}")
    return backend


def host_pool(layout="page_first"):
    host = MLAHostPool(kvshard.Device.cpu(), geometry(), PAGES, layout, "direct" if layout == "page_first_direct" else "kernel")
    host.kv_buffer[...] = POISON
    host.indexer.index_k_with_scale_buffer[...] = POISON
    return host


def page_bytes(host, page):
    """Every component of host page `page` (latent with the packed draft, then indexer), per
    layer and token whatever the host layout, so pools of different layouts compare."""
    latent = host.get_data_page(page * PAGE, flat=False)
    if host.layout == "page_first":
        latent = latent.transpose(1, 0, 2, 3)  # [tokens, L, 1, row] -> [L, tokens, 1, row]
    indexer = host.indexer.get_data_page(page * PAGE, flat=False)
    return np.ascontiguousarray(latent).tobytes() + np.ascontiguousarray(indexer).tobytes()


def fill(host, page, rng):
    """Random non-zero bytes in every component of host page `page`."""
    for pool in (host, host.indexer):
        flat = pool.get_data_page(page * PAGE, flat=True)
        pool.set_from_flat_data_page(page * PAGE, rng.integers(1, 256, size=flat.shape, dtype=np.uint8).view(flat.dtype))


def indices(pages):
    return np.array([p * PAGE + t for p in pages for t in range(PAGE)], dtype=np.int64)


def chain(n, seed=0):
    """SGLang's page hashes of an n-page token sequence."""
    tokens = [(seed * 7919 + i * 2654435761) % (1 << 32) for i in range(n * PAGE)]
    return page_hashes(tokens)


def sglang_get_hash_str(token_ids, prior_hash=None):
    """SGLang's get_hash_str (hicache_storage.py), with hashlib."""
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    for t in token_ids:
        hasher.update(t.to_bytes(4, byteorder="little", signed=False))
    return hasher.hexdigest()


def test_reports_which_base_class_it_ran_against():
    assert issubclass(KvshardStorage, HiCacheStorage)
    try:
        importlib.import_module("sglang.srt.mem_cache.hicache_storage")
        sglang = True
    except ImportError:
        sglang = False
    assert BASE_CLASS == ("sglang" if sglang else "stand-in")
    assert sglang_storage.HiCacheStorage.__module__.startswith("sglang") == sglang
    warnings.warn(
        f"KvshardStorage was tested against {'SGLang' if sglang else 'the stand-in'} "
        f"HiCacheStorage (BASE_CLASS={BASE_CLASS!r})",
        stacklevel=1,
    )


def test_page_hash_chain_is_sglangs_get_hash_str():
    rng = np.random.default_rng(3)
    tokens = [int(t) for t in rng.integers(0, 1 << 32, size=3 * PAGE + 5, dtype=np.uint64)]
    tokens[0], tokens[1] = 0, (1 << 32) - 1
    want, prior = [], None
    for i in range(3):
        prior = sglang_get_hash_str(tokens[i * PAGE : (i + 1) * PAGE], prior)
        want.append(prior)
    assert page_hashes(tokens) == want  # the trailing partial page has no hash
    assert page_hash(tokens[PAGE : 2 * PAGE], want[0]) == want[1]
    seed = hashlib.sha256(b"parent").hexdigest()
    assert page_hashes(tokens[:PAGE], seed) == [sglang_get_hash_str(tokens[:PAGE], seed)]
    assert page_hashes(tokens[:PAGE], bytes.fromhex(seed)) == [sglang_get_hash_str(tokens[:PAGE], seed)]
    # Keys: namespace || page hash, the same from hex strings, bytes or the tokens.
    ns = Namespace(geometry(), b"test")
    assert ns.key(want[1]) == ns.bytes + bytes.fromhex(want[1])
    assert ns.keys(want) == ns.chain_keys(tokens) == [ns.bytes + bytes.fromhex(h) for h in want]
    assert len(ns.key(want[0])) == KEY_BYTES
    # The namespace separates tenants and indexer scale rules.
    assert Namespace(geometry(), b"other").bytes != ns.bytes
    assert Namespace(geometry(), b"test", IndexerScale.PLAIN).bytes != ns.bytes
    for bad in ([-1] * PAGE, [1 << 32] * PAGE):
        with pytest.raises(InvalidArgumentError):
            page_hashes(bad)
    with pytest.raises(InvalidArgumentError):
        page_hash(tokens[: PAGE - 1])
    with pytest.raises(InvalidArgumentError):
        ns.key("not a page hash")


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_v1_round_trip_exists_and_misses(store_dir, layout):
    rng = np.random.default_rng(1)
    host = host_pool(layout)
    backend = open_backend(config(store_dir), host)
    keys = chain(6)
    src = [1, 2, 3, 4]
    for p in src:
        fill(host, p, rng)
    want = [page_bytes(host, p) for p in src]
    assert backend.batch_set_v1(keys[:4], indices(src)) == [True] * 4
    # Storing again is a hit, not a second write.
    assert backend.batch_set_v1(keys[:2], indices(src[:2])) == [True, True]
    assert backend.get_stats()["stored_pages"] == 4

    # Prefix semantics: the leading run of hits.
    assert backend.batch_exists(keys) == 4
    assert backend.batch_exists([keys[0], keys[5], keys[2]]) == 1
    assert backend.batch_exists(["zz", keys[0]]) == 0
    assert backend.exists(keys[3]) and not backend.exists(keys[4])

    # Reload into other host pages, byte-identical; the misses leave their pages untouched.
    dst = [5, 6, 7, 8, 9, 10]
    assert backend.batch_get_v1(keys, indices(dst)) == [True] * 4 + [False] * 2
    assert [page_bytes(host, p) for p in dst[:4]] == want
    for p in dst[4:]:
        assert set(page_bytes(host, p)) == {POISON}
    # Indices that are not whole pages, or do not cover the keys, fail without moving bytes.
    assert backend.batch_get_v1(keys[:2], indices([9])) == [False, False]
    assert backend.batch_get_v1(keys[:1], indices([9]) + 1) == [False]
    assert set(page_bytes(host, 9)) == {POISON}
    # The padding page 0, and a page past the pool, fail alone; the batch's others move.
    assert backend.batch_get_v1(keys[:3], indices([0, 9, PAGES])) == [False, True, False]
    assert page_bytes(host, 9) == want[1]

    # The legacy per-tensor calls name the zero-copy ones.
    for call in (lambda: backend.get(keys[0]), lambda: backend.set(keys[0], None),
                 lambda: backend.batch_get(keys), lambda: backend.batch_set(keys, [])):
        with pytest.raises(NotImplementedError, match="batch_get_v1"):
            call()
    assert backend.clear() is False


def test_a_second_tp_rank_reads_rank_zeros_pages(store_dir):
    """SGLang's MLA rule: only TP rank 0 backs pages up; rank 1 (which never writes) finds and
    loads them, so the hit SGLang min-reduces over the TP group is the same on both."""
    rng = np.random.default_rng(2)
    host0, host1 = host_pool(), host_pool("page_first_direct")
    rank0 = open_backend(config(store_dir, 0, 2), host0)
    rank1 = open_backend(config(store_dir, 1, 2), host1)
    keys = chain(3, seed=1)
    for p in (1, 2, 3):
        fill(host0, p, rng)
    assert rank0.batch_set_v1(keys, indices([1, 2, 3])) == [True] * 3
    assert rank0.batch_exists(keys) == rank1.batch_exists(keys) == 3
    assert rank1.batch_get_v1(keys, indices([4, 5, 6])) == [True] * 3
    assert [page_bytes(host1, p) for p in (4, 5, 6)] == [page_bytes(host0, p) for p in (1, 2, 3)]
    assert rank1.get_stats()["stored_pages"] == 0


def test_v2_kv_indexer_and_draft_pools(store_dir):
    rng = np.random.default_rng(4)
    host = host_pool()
    backend = open_backend(config(store_dir), host)
    # SGLang registers each pool by name; the indexer is the companion of the same host pool,
    # the draft is packed into it (SGLang's NextN mode).
    backend.register_mem_host_pool_v2(host, PoolName.KV)
    backend.register_mem_host_pool_v2(host.indexer, PoolName.INDEXER)
    backend.register_mem_host_pool_v2(host, PoolName.DRAFT)
    keys = chain(4, seed=2)
    src = [1, 2, 3]
    for p in src:
        fill(host, p, rng)

    def transfers(pages, ks, names=(PoolName.KV, PoolName.INDEXER, PoolName.DRAFT)):
        return [PoolTransfer(name=n, host_indices=indices(pages), keys=ks) for n in names]

    got = backend.batch_set_v2(transfers(src, keys[:3]))
    assert got == {PoolName.KV: [True] * 3, PoolName.INDEXER: [True] * 3, PoolName.DRAFT: [True] * 3}
    assert backend.get_stats()["stored_pages"] == 3  # one slot per page, every pool in it

    extra = [
        PoolTransfer(name=PoolName.INDEXER, keys=keys),
        PoolTransfer(name=PoolName.DRAFT, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
    ]
    r = backend.batch_exists_v2(keys, extra)
    assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (3, {PoolName.KV: 3, PoolName.INDEXER: 3, PoolName.DRAFT: 3})
    # A pool kvshard does not hold never hits, and with it no page counts.
    r = backend.batch_exists_v2(keys, extra + [PoolTransfer(name=PoolName.MAMBA, keys=keys)])
    assert r.kv_hit_pages == 0
    assert backend.batch_exists_v2(keys[3:], extra).kv_hit_pages == 0

    dst = [6, 7, 8]
    got = backend.batch_get_v2(transfers(dst, keys[:3]))
    assert got == {PoolName.KV: [True] * 3, PoolName.INDEXER: [True] * 3, PoolName.DRAFT: [True] * 3}
    assert [page_bytes(host, p) for p in dst] == [page_bytes(host, p) for p in src]
    # Transfers naming other host pages for one key: one slot cannot land in two pages, so
    # that page fails in every pool and nothing moves for it; an unregistered pool fails.
    t = transfers([9, 10], keys[:2], (PoolName.KV,)) + transfers([9, 11], keys[:2], (PoolName.INDEXER,))
    t.append(PoolTransfer(name=PoolName.MAMBA, host_indices=indices([9]), keys=keys[:1]))
    got = backend.batch_get_v2(t)
    assert got == {PoolName.KV: [True, False], PoolName.INDEXER: [True, False], PoolName.MAMBA: [False]}
    assert set(page_bytes(host, 10)) == set(page_bytes(host, 11)) == {POISON}
    # Pools over another host pool are refused.
    with pytest.raises(InvalidArgumentError):
        backend.register_mem_host_pool_v2(host_pool(), PoolName.DRAFT_INDEXER)


def test_a_corrupted_slot_is_a_counted_miss(store_dir):
    rng = np.random.default_rng(5)
    host = host_pool()
    backend = open_backend(config(store_dir), host)
    keys = chain(2, seed=3)
    for p in (1, 2):
        fill(host, p, rng)
    assert backend.batch_set_v1(keys, indices([1, 2])) == [True, True]
    # Flip bytes of the second page's slot in the data file (found by a run of its latent bytes).
    needle = host.get_data_page(2 * PAGE).tobytes()[:64]
    [data] = list(store_dir.glob("w0000.slots"))
    raw = bytearray(data.read_bytes())
    at = raw.find(needle)
    assert at >= 0 and raw.find(needle, at + 1) < 0
    raw[at : at + 8] = bytes(b ^ 0xFF for b in raw[at : at + 8])
    with open(data, "r+b") as f:
        f.seek(at)
        f.write(raw[at : at + 8])
        f.flush()
        os.fsync(f.fileno())
    # Still indexed, but its load fails its checksum: a miss, its host page untouched, counted.
    assert backend.batch_exists(keys) == 2
    assert backend.batch_get_v1(keys, indices([3, 4])) == [True, False]
    assert page_bytes(host, 3) == page_bytes(host, 1)
    assert set(page_bytes(host, 4)) == {POISON}
    assert backend.get_stats()["corrupt_pages"] == 1
    # The damaged slot is dropped: from now on it is absent.
    assert backend.batch_exists(keys) == 1


def test_configurations_it_refuses(store_dir):
    need_nixl("KvshardStorage")
    # A CP rank outside its group's files (CP-sharded pools are served: each CP rank writes its
    # own stripe, test_sglang_objects_cpu.py).
    cp = config(store_dir, writer=2)
    cp.attn_cp_size = 2
    with pytest.raises(InvalidArgumentError, match="writer"):
        create_backend(cp)
    no_dir = config(store_dir)
    del no_dir.extra_config["dir"]
    with pytest.raises(InvalidArgumentError, match="'dir'"):
        create_backend(no_dir)
    not_mla = config(store_dir)
    not_mla.is_mla_model = False
    with pytest.raises(InvalidArgumentError, match="MLA"):
        create_backend(not_mla)
    backend = create_backend(config(store_dir, indexer_scale="plain"))
    with pytest.raises(InvalidArgumentError, match="MLAHostPool"):
        backend.register_mem_pool_host(object())
    # Before a host pool is registered, nothing is present and nothing moves.
    assert backend.batch_exists(chain(1)) == 0
    assert backend.batch_get_v1(chain(1), indices([1])) == [False]
    assert backend.get_stats() is None


def test_storage_errors_are_typed(store_dir):
    need_nixl("DiskStore")
    host = host_pool()
    try:
        kvshard.storage.DiskStore(host.host, store_dir / "s", 4)
    except UnavailableError as e:
        if os.environ.get("KVSHARD_REQUIRE_NIXL"):
            raise
        pytest.skip(f"NIXL runtime missing: {e}")
    # A directory that cannot be made (under a regular file).
    (store_dir / "file").write_bytes(b"x")
    with pytest.raises(StorageError) as e:
        kvshard.storage.DiskStore(host.host, store_dir / "file" / "s", 4)
    assert (e.value.failure, isinstance(e.value, HiCacheError)) == ("open", True)
    assert str(store_dir / "file") in e.value.path
    # Files of another shape (slot count) are refused, not reinterpreted.
    with pytest.raises(StorageError) as e:
        kvshard.storage.DiskStore(host.host, store_dir / "s", 8)
    assert e.value.failure == "format"
    with pytest.raises(InvalidArgumentError):
        kvshard.storage.DiskStore(host.host, store_dir / "t", 4, writer=2, writers=2)


def sglang_pools(page_num, dsa=True):
    """Stand-ins for SGLang's own host pools of a DSA model with a packed MTP draft
    (``MLATokenToKVPoolHost`` and ``DSAIndexerPoolHost``, page_first): the attributes
    ``adopt_sglang_pools`` reads, and NumPy buffers of SGLang's shapes, poisoned."""
    size = page_num * PAGE
    device_pool = SimpleNamespace(start_layer=0, device="cpu", index_head_dim=128 if dsa else None)
    kv = SimpleNamespace(
        kv_buffer=np.full((size, 4, 1, 656), POISON, np.uint8),  # 3 target layers + the draft
        kv_cache_dim=656,
        dtype=np.dtype(np.uint8),
        target_layer_num=3,
        layer_num=4,
        page_num=page_num,
        page_size=PAGE,
        layout="page_first",
        pin_memory=False,
        device_pool=device_pool,
    )
    # Layer 1 shares layer 0's indexer (no buffer); the draft's is the tail layer.
    indexer = SimpleNamespace(
        index_k_with_scale_buffer=np.full(((size + PAGE + 1) // PAGE, 3, 1, 8448), POISON, np.uint8),
        _live_target_layers=[0, 2],
        layer_num=3,
        page_size=PAGE,
        layout="page_first",
    )
    return kv, indexer


def sglang_page(kv, indexer, page):
    return kv.kv_buffer[page * PAGE : (page + 1) * PAGE].tobytes() + indexer.index_k_with_scale_buffer[page].tobytes()


def test_sglangs_own_host_pools_are_adopted(store_dir):
    """Stock SGLang registers its own MLA and DSA indexer host pools: they are wrapped (no copy)
    at the first storage call, and pages written through SGLang's indexing round-trip."""
    rng = np.random.default_rng(6)
    kv, indexer = sglang_pools(PAGES)
    backend = open_backend(config(store_dir), kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
    for p in (1, 2):
        kv.kv_buffer[p * PAGE : (p + 1) * PAGE] = rng.integers(1, 256, (PAGE, 4, 1, 656), np.uint8)
        indexer.index_k_with_scale_buffer[p] = rng.integers(1, 256, (3, 1, 8448), np.uint8)
    keys = chain(2, seed=4)
    assert backend.batch_set_v1(keys, indices([1, 2])) == [True, True]
    assert backend.batch_exists(keys) == 2
    got = backend.batch_get_v2(
        [PoolTransfer(name=n, host_indices=indices([5, 6]), keys=keys) for n in (PoolName.KV, PoolName.INDEXER)]
    )
    assert got == {PoolName.KV: [True, True], PoolName.INDEXER: [True, True]}
    assert [sglang_page(kv, indexer, p) for p in (5, 6)] == [sglang_page(kv, indexer, p) for p in (1, 2)]
    assert set(sglang_page(kv, indexer, 7)) == {POISON}
    # Another SGLang indexer pool cannot join the one host pool.
    with pytest.raises(InvalidArgumentError):
        backend.register_mem_host_pool_v2(sglang_pools(PAGES)[1], PoolName.DRAFT_INDEXER)


def test_a_dsa_pool_without_its_indexer_is_never_stored(store_dir):
    """Pages stored without the indexer state would come back as hits with stale indexer bytes:
    a DSA model's MLA pool registered alone is refused at the first call, and nothing is stored."""
    kv, _ = sglang_pools(PAGES)
    backend = open_backend(config(store_dir), kv)
    assert backend.batch_set_v1(chain(1), indices([1])) == [False]
    assert backend.batch_exists(chain(1)) == 0 and backend.get_stats() is None
    # Without an indexer (a plain MLA model), the latent alone is the whole page.
    mla, _ = sglang_pools(PAGES, dsa=False)
    mla.kv_buffer[PAGE : 2 * PAGE] = 7
    plain = open_backend(config(store_dir / "plain"), mla)
    assert plain.batch_set_v1(chain(1), indices([1])) == [True]
    assert plain.batch_get_v1(chain(1), indices([3])) == [True]
    assert set(mla.kv_buffer[3 * PAGE : 4 * PAGE].tobytes()) == {7}


def test_the_first_calls_of_two_threads_open_one_store(store_dir, monkeypatch):
    """SGLang's prefetch and backup threads can make the first storage call together: one store
    opens (two would both append to this rank's journal)."""
    from concurrent.futures import ThreadPoolExecutor

    kv, indexer = sglang_pools(PAGES)
    backend = open_backend(config(store_dir), kv)
    backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
    opened = []
    real = kvshard.storage.DiskStore

    def counting(*args, **kwargs):
        opened.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kvshard.storage, "DiskStore", counting)
    with ThreadPoolExecutor(8) as pool:
        hits = list(pool.map(lambda _: backend.batch_exists(chain(1)), range(8)))
    assert hits == [0] * 8 and len(opened) == 1
