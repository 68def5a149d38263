"""kvshard inside SGLang 0.5.23's own objects, on the CPU.

- The stand-in base class (``kvshard._hicache_stand_in``, used where SGLang does not import) has
  SGLang's signatures, fields and members, checked against SGLang's own.
- ``KvshardStorage`` is created by SGLang's own ``StorageBackendFactory`` (``dynamic``, with
  ``module_path`` and ``class_name`` in ``extra_config``), subclasses SGLang's own
  ``HiCacheStorage``, and is driven through SGLang's storage calls (``register_mem_pool_host``,
  ``register_mem_host_pool_v2``, ``on_host_pools_registered``, v1 and v2) on host pools SGLang's
  own classes built: ``MLATokenToKVPoolHost`` (target layers + the packed MTP draft) and
  ``DSAIndexerPoolHost`` (a shared-indexer layer skipped, the draft's indexer as its tail), in
  each host layout SGLang offers for them, with ``pin_memory=False`` (SGLang's own flag: no
  ``cudaHostRegister`` on the CPU). Every page is compared through SGLang's own page access
  (``get_data_page``) after a round trip through the disk.
- The same under SGLang's own ``HiCacheStorageFailureInjector``: no call it fails may change a
  host page or report a hit it did not load.

The storage tier needs NIXL's runtime (as test_sglang_storage_cpu.py); SGLang is required with
``KVSHARD_REQUIRE_SGLANG=1``.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import random
from types import SimpleNamespace

import numpy as np
import pytest

import kvshard
from kvshard.geometry import PAGE_SIZE
from kvshard.storage import page_hashes
import sglang_oracle
from kvshard import _hicache_stand_in as stand_in
from test_sglang_storage_cpu import need_nixl, store_dir  # noqa: F401 (a fixture)

PAGE = PAGE_SIZE
LAYERS = 3
SKIP = [False, True, False]  # layer 1 reuses another layer's top-k: no indexer buffer
PAGES = 8  # SGLang's device capacity in pages; its host pool holds PAGES * 2 + 1


@pytest.fixture(scope="module")
def sg():
    return sglang_oracle.sglang(
        storage="mem_cache.hicache_storage",
        factory="mem_cache.storage.backend_factory",
        info="mem_cache.device_pool_info",
        mla="mem_cache.pool_host.mla",
        dsa="mem_cache.pool_host.dsa",
        decl="mem_cache.pool_host.host_pool_decl",
    )


# --- the stand-in has SGLang's interface ------------------------------------------------------


def _signature(f):
    return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]


def test_stand_in_matches_sglang(sg):
    from kvshard import sglang_storage

    assert sglang_storage.BASE_CLASS == "sglang"
    assert sglang_storage.HiCacheStorage is sg.storage.HiCacheStorage
    for name in stand_in.__all__:
        ours, theirs = getattr(stand_in, name), getattr(sg.storage, name)
        if issubclass(theirs, enum.Enum):
            assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs], name
            assert str(ours.KV if name == "PoolName" else ours.ALL_PAGES) == str(
                theirs.KV if name == "PoolName" else theirs.ALL_PAGES
            )
            continue
        if dataclasses.is_dataclass(theirs):
            assert [(f.name, f.default) for f in dataclasses.fields(ours)] == [
                (f.name, f.default) for f in dataclasses.fields(theirs)
            ], name
        public = {n for n, v in vars(theirs).items() if not n.startswith("_") and (callable(v) or isinstance(v, (property, classmethod)))}
        assert public == {n for n, v in vars(ours).items() if not n.startswith("_") and (callable(v) or isinstance(v, (property, classmethod)))}, name
        for method in public:
            a, b = inspect.getattr_static(ours, method), inspect.getattr_static(theirs, method)
            if isinstance(a, property):
                continue
            assert _signature(getattr(ours, method)) == _signature(getattr(theirs, method)), (name, method)
        assert getattr(ours, "__abstractmethods__", frozenset()) == getattr(theirs, "__abstractmethods__", frozenset())
    sglang_oracle.tally("stand-in interface", 1, len(stand_in.__all__))


# --- SGLang's own host pools ---------------------------------------------------------------------


def sglang_host_pools(sg, layout):
    """SGLang's MLA host pool (3 target layers + the packed draft, 576-B FP8 rows) and its DSA
    indexer host pool over the same pages, built by SGLang's classes from CPU device buffers."""
    built = sglang_oracle.host_pools(layout, skip=SKIP, pages=PAGES)
    return built.kv, built.indexer


def storage_config(sg, store_dir, layout, *, tp_rank=0, tp_size=1, cp_rank=0, cp_size=1, **extra):
    return sg.storage.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=cp_rank, attn_cp_size=cp_size,
        is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=layout != "layer_first",
        model_name="test/dsa",
        extra_config={
            "backend_name": "kvshard", "module_path": "kvshard.sglang_storage", "class_name": "KvshardStorage",
            "dir": str(store_dir), "slots": 32, "tenant": "sglang-objects", **extra,
        },
    )


def fill(kv, indexer, pages, rng):
    """Random non-zero bytes in host pages ``pages`` of both pools (SGLang's own page setters)."""
    import torch

    for p in pages:
        for pool in (kv, indexer):
            n = pool.get_data_page(p * PAGE, flat=True).numel()
            pool.set_from_flat_data_page(p * PAGE, torch.from_numpy(rng.integers(1, 256, n, dtype=np.uint8)))


def page(pool, p):
    return bytes(pool.get_data_page(p * PAGE, flat=True).numpy())


def slots(pages):
    import torch

    return torch.tensor([p * PAGE + o for p in pages for o in range(PAGE)], dtype=torch.int64)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_storage_round_trips_in_sglang_objects(sg, store_dir, layout):  # noqa: F811
    """SGLang's factory creates the backend; SGLang's host pools are registered as its
    controller registers them; v2 stores both pools' pages, finds them, and loads them into
    other host pages byte for byte; v1 does the same for the KV pool (its slot holds every
    component, so the indexer pages come back too)."""
    need_nixl("the SGLang-objects storage test")
    kv, indexer = sglang_host_pools(sg, layout)
    PoolName, PoolTransfer = sg.storage.PoolName, sg.storage.PoolTransfer
    backend = sg.factory.StorageBackendFactory.create_backend("dynamic", storage_config(sg, store_dir, layout), kv)
    assert isinstance(backend, sg.storage.HiCacheStorage)
    assert type(backend).__name__ == "KvshardStorage"
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
    backend.on_host_pools_registered()

    rng = np.random.default_rng(7)
    src, dst = [1, 2, 3, 4], [9, 10, 11, 12]
    fill(kv, indexer, src + dst, rng)
    keys = page_hashes(list(rng.integers(0, 50_000, len(src) * PAGE)))
    stored = backend.batch_set_v2(
        [PoolTransfer(PoolName.KV, host_indices=slots(src), keys=keys),
         PoolTransfer(PoolName.INDEXER, host_indices=slots(src), keys=keys)]
    )
    assert stored == {PoolName.KV: [True] * 4, PoolName.INDEXER: [True] * 4}
    hit = backend.batch_exists_v2(keys + ["00" * 32], [PoolTransfer(PoolName.INDEXER, keys=keys)])
    assert hit.kv_hit_pages == 4 and hit.extra_pool_hit_pages[PoolName.INDEXER] == 4
    loaded = backend.batch_get_v2(
        [PoolTransfer(PoolName.KV, host_indices=slots(dst), keys=keys),
         PoolTransfer(PoolName.INDEXER, host_indices=slots(dst), keys=keys)]
    )
    assert loaded == {PoolName.KV: [True] * 4, PoolName.INDEXER: [True] * 4}
    for s, d in zip(src, dst):
        assert page(kv, d) == page(kv, s) and page(indexer, d) == page(indexer, s)

    # v1 on the anchor pool: another prefix, loaded back into yet other pages.
    more = page_hashes(list(rng.integers(0, 50_000, 2 * PAGE)))
    fill(kv, indexer, [5, 6, 13, 14], rng)
    assert backend.batch_set_v1(more, slots([5, 6])) == [True, True]
    assert backend.batch_exists(more) == 2
    assert backend.batch_get_v1(more, slots([13, 14])) == [True, True]
    for s, d in zip([5, 6], [13, 14]):
        assert page(kv, d) == page(kv, s) and page(indexer, d) == page(indexer, s)
    sglang_oracle.tally(f"storage in SGLang's objects ({layout})", 1, 7)


def test_storage_under_sglangs_failure_injector(sg, store_dir):  # noqa: F811
    """SGLang's own ``HiCacheStorageFailureInjector`` (half the calls fail, as SGLang's
    ``SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE`` sets it) around the backend: a failed call
    answers as SGLang's injector does and touches no host page; every page reported loaded has
    the bytes that were stored under its key."""
    need_nixl("the failure-injector storage test")
    import torch

    kv, indexer = sglang_host_pools(sg, "page_first")
    PoolName, PoolTransfer = sg.storage.PoolName, sg.storage.PoolTransfer
    inner = sg.factory.StorageBackendFactory.create_backend("dynamic", storage_config(sg, store_dir, "page_first"), kv)
    backend = sg.storage.HiCacheStorageFailureInjector(inner, 0.0, 0.5)
    backend._thread_local.random = random.Random(11)
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
    rng = np.random.default_rng(3)
    truth: dict[str, tuple[bytes, bytes]] = {}
    injected = survived = wrong = 0
    for step in range(40):
        src = [1 + step % 6]
        fill(kv, indexer, src, rng)
        key = page_hashes(list(rng.integers(0, 50_000, PAGE)))
        stored = backend.batch_set_v2(
            [PoolTransfer(PoolName.KV, host_indices=slots(src), keys=key),
             PoolTransfer(PoolName.INDEXER, host_indices=slots(src), keys=key)]
        )
        if stored.get(PoolName.KV) == [True]:
            truth[key[0]] = (page(kv, src[0]), page(indexer, src[0]))
        else:
            injected += 1
        # Load a random known key into page 15, poisoned first.
        if truth:
            k = random.Random(step).choice(sorted(truth))
            for pool in (kv, indexer):
                n = pool.get_data_page(15 * PAGE, flat=True).numel()
                pool.set_from_flat_data_page(15 * PAGE, torch.full((n,), 0xA5, dtype=torch.uint8))
            before = (page(kv, 15), page(indexer, 15))
            got = backend.batch_get_v2(
                [PoolTransfer(PoolName.KV, host_indices=slots([15]), keys=[k]),
                 PoolTransfer(PoolName.INDEXER, host_indices=slots([15]), keys=[k])]
            )
            if got.get(PoolName.KV) == [True]:
                wrong += (page(kv, 15), page(indexer, 15)) != truth[k]
                survived += 1
            else:
                injected += 1
                wrong += (page(kv, 15), page(indexer, 15)) != before
    assert injected > 0 and survived > 0
    assert wrong == 0
    sglang_oracle.tally("storage under SGLang's failure injector", 1, 80)


# --- each rank stores its own stripe (SGLang's page-interleave host pools) ------------------------


@pytest.mark.parametrize("shard", [2, 4])
def test_each_rank_stores_its_own_stripe(sg, store_dir, shard):  # noqa: F811
    """The gap SGLang 0.5.23 names ("the storage path reads and writes whole pages per rank, not
    each rank's own stripe"), closed: N CP ranks in one process, each with SGLang's own MLA and
    DSA indexer host pools behind SGLang's ``PageInterleaveHostPool``, each storing through its
    ``KvshardStorage`` (writer = its CP rank) only the pages it owns of a prefix. Every rank
    then finds the whole prefix (all ranks' pages, every component), and the group reloads it
    into a new chain whose owners are rotated (a prefix reused by another request), each rank
    loading its own pages of the new chain from whichever rank wrote them: byte-identical to
    the unsharded pages. A prefix one rank never stored is found by no rank past that rank's
    first page (all components of a page, or none)."""
    need_nixl("the striped storage test")
    import torch
    from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec
    from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool

    PoolName = sg.storage.PoolName
    ranks = []
    for rank in range(shard):
        kv, indexer = sglang_host_pools(sg, "page_first")
        spec = PageShardSpec(
            shard_rank=rank, shard_size=shard, page_size=PAGE, max_prefix_tokens=shard * PAGE, chunk_tokens=PAGE
        )
        facade = PageInterleaveHostPool(kv, PageInterleavePlacement(spec))
        backend = sg.factory.StorageBackendFactory.create_backend(
            "dynamic", storage_config(sg, store_dir, "page_first", cp_rank=rank, cp_size=shard), facade
        )
        backend.register_mem_pool_host(facade)
        backend.register_mem_host_pool_v2(facade, PoolName.KV)
        backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
        assert backend.writer == rank and backend.writers == shard
        ranks.append(SimpleNamespace(kv=kv, indexer=indexer, facade=facade, backend=backend))

    rng = np.random.default_rng(shard)
    pages = 2 * shard + 1
    n_kv = ranks[0].kv.get_data_page(PAGE, flat=True).numel()
    n_ix = ranks[0].indexer.get_data_page(PAGE, flat=True).numel()
    # The unsharded pages: what SGLang's unsharded host pools hold for each chain position.
    reference = [(rng.integers(1, 256, n_kv, dtype=np.uint8), rng.integers(1, 256, n_ix, dtype=np.uint8)) for _ in range(pages)]
    keys = page_hashes(list(rng.integers(0, 50_000, pages * PAGE)))

    def chain(start_owner):
        # Every rank's facade runs the same owner-classed allocator: the same logical slots.
        slots = [r.facade.alloc(pages * PAGE, start_owner=start_owner) for r in ranks]
        assert all(torch.equal(slots[0], s) for s in slots)
        return slots[0]

    def local(logical_page):
        return logical_page % shard, logical_page // shard

    stored = chain(1)
    for position in range(pages):
        owner, page_no = local(int(stored[position * PAGE]) // PAGE)
        r = ranks[owner]
        r.kv.set_from_flat_data_page(page_no * PAGE, torch.from_numpy(reference[position][0]))
        r.indexer.set_from_flat_data_page(page_no * PAGE, torch.from_numpy(reference[position][1]))

    # Rank 0 alone first: no rank finds the prefix past the first page rank 0 does not own.
    assert ranks[0].backend.batch_set_v1(keys, stored) == [True] * pages
    first_missing = next(p for p in range(pages) if local(int(stored[p * PAGE]) // PAGE)[0] != 0)
    assert [r.backend.batch_exists(keys) for r in ranks] == [first_missing] * shard
    for r in ranks[1:]:
        assert r.backend.batch_set_v1(keys, stored) == [True] * pages
    assert [r.backend.batch_exists(keys) for r in ranks] == [pages] * shard
    # Each rank wrote its own stripe, once: its pages, into its own file.
    owned = [sum(local(int(stored[p * PAGE]) // PAGE)[0] == i for p in range(pages)) for i in range(shard)]
    assert [r.backend.get_stats()["stored_pages"] for r in ranks] == owned

    # Reused in a new chain, owners rotated by one: every rank loads its own pages of it.
    reloaded = chain(2 % shard)
    for i, r in enumerate(ranks):
        got = r.backend.batch_get_v2(
            [sg.storage.PoolTransfer(PoolName.KV, host_indices=reloaded, keys=keys),
             sg.storage.PoolTransfer(PoolName.INDEXER, host_indices=reloaded, keys=keys)]
        )
        assert got == {PoolName.KV: [True] * pages, PoolName.INDEXER: [True] * pages}
    moved_across = 0
    for position in range(pages):
        owner, page_no = local(int(reloaded[position * PAGE]) // PAGE)
        r = ranks[owner]
        assert page(r.kv, page_no) == reference[position][0].tobytes()
        assert page(r.indexer, page_no) == reference[position][1].tobytes()
        moved_across += owner != local(int(stored[position * PAGE]) // PAGE)[0]
    assert moved_across > 0  # pages read back by a rank that did not write them
    sglang_oracle.tally(f"striped storage, CP{shard}", 1, 2 * shard + pages)


def test_extra_config_numbers_are_bounded(sg, store_dir):  # noqa: F811
    """Writers, writer, slots, staging slots and the timeout from extra_config are checked
    before anything opens: a clear InvalidArgumentError naming the key (u32::MAX writers used
    to reach the store and abort)."""
    for bad in (
        {"writers": 2**32 - 1}, {"writers": 0}, {"writer": 3, "writers": 2}, {"writer": -1},
        {"slots": 0}, {"slots": "many"}, {"staging_slots": 0}, {"timeout": 0},
        {"timeout": float("nan")}, {"timeout": 1e9}, {"writers": True},
    ):
        config = storage_config(sg, store_dir, "page_first", **bad)
        with pytest.raises(kvshard.error.InvalidArgumentError, match=next(iter(bad))):
            sg.factory.StorageBackendFactory.create_backend("dynamic", config, None)
