"""SGLang's HiCache storage interface (L3) on kvshard's storage tier.

``KvshardStorage`` implements SGLang's ``HiCacheStorage`` (``mem_cache/hicache_storage.py``)
over a kvshard ``DiskStore``: one preallocated slot file and one journal per rank in a
directory shared by the ranks, moved by NIXL's POSIX backend with direct I/O. Stock SGLang
loads it through its ``dynamic`` storage backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "kvshard", "module_path": "kvshard.sglang_storage",
        "class_name": "KvshardStorage", "dir": "/mnt/nvme/kvshard-l3", "slots": 65536}'

SGLang's factory calls ``KvshardStorage(storage_config, kwargs)``; the controller then
registers its host pools: kvshard's ``kvshard.sglang.MLAHostPool`` (one kvshard ``HostPool``
holding every component of a page: latent, MTP draft, indexer keys and scales; the store opens
there), or SGLang's own ``MLATokenToKVPoolHost`` and ``DSAIndexerPoolHost``, wrapped without a
copy at the first storage call (``adopt_sglang_pools``).

What it guarantees, by construction of kvshard's store:

- **A page is all or nothing.** One slot holds every component of the host page, with a
  checksum; its commit record is written after the data is durable. A v2 call's extra pools
  (``indexer``, ``draft``, ...) registered over the same host pool therefore hit exactly where
  the KV pool hits: a page counts only if every pool has it, and that holds per slot. A pool
  kvshard does not hold (not registered, or over another host pool) never hits.
- **Torn and corrupted slots are misses**, counted (``get_stats()["corrupt_pages"]``).
- **Keys** are ``namespace || page hash``: SGLang's hex page hashes (its ``get_hash_str``
  SHA-256 chain, the same as ``kvshard.storage.page_hashes``) under a namespace of the cache's geometry,
  indexer scale rule, kvshard's layout version and a tenant tag, so two deployments with other
  bytes per page never read each other's pages.

``extra_config`` keys (besides SGLang's ``backend_name``, ``module_path``, ``class_name``):

- ``dir`` (required): the directory the ranks share (a local disk, or a shared filesystem
  across hosts); pipeline stages get a subdirectory each (``pp{rank}``).
- ``slots`` (required): pages each rank's file holds (preallocated: ``slots`` x the slot size,
  every component of a page padded to the direct-I/O alignment); least recently used reclaimed.
- ``tenant`` (default ``""``): a tag in the namespace (separates deployments sharing ``dir``).
- ``indexer_scale`` (``"ue8m0"``, the default, or ``"plain"``): how the indexer scales were
  computed; part of the namespace.
- ``writer``, ``writers``: this rank's file and the number of files. By default one per
  (attention DP, CP, TP) rank: ``writer = (dp_rank * cp_size + cp_rank) * tp_size + tp_rank``
  (``1 <= writers <= 4096``). Under SGLang's MLA rule
  only TP rank 0 backs pages up, so the other ranks' files stay empty, but every rank reads
  rank 0's pages: the hit SGLang min-reduces over the TP group is the same on every rank.
- ``staging_slots`` (default 32, at most 65536), ``timeout`` (seconds, default 30, at most
  3600). Every number is checked at construction: a bad one raises ``InvalidArgumentError``
  naming its key.

CP-sharded caches: registered with SGLang's ``PageInterleaveHostPool``, each rank stores and
loads only the pages it owns (host indices are logical; docs/sglang.md, "Each rank stores its
own stripe"). Refused: non-MLA models. The legacy ``get``/``set``/``batch_get``/
``batch_set`` (per-page tensors) raise ``NotImplementedError``: use the zero-copy v1/v2 calls.

The base class is SGLang's own when ``sglang`` imports, else a stand-in with the same
signatures (``BASE_CLASS`` says which; the choice is logged at import).
"""

from __future__ import annotations

import logging
import operator
import os
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import kvshard
from kvshard.sglang import DSAIndexerHostPool, MLAHostPool

logger = logging.getLogger(__name__)

PAGE_SIZE = kvshard.geometry.PAGE_SIZE

if TYPE_CHECKING:
    from ._hicache_stand_in import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
        PoolTransferResult,
    )

    _STAND_IN_WHY: str
else:
    try:
        from sglang.srt.mem_cache.hicache_storage import (
            HiCacheStorage,
            HiCacheStorageConfig,
            HiCacheStorageExtraInfo,
            PoolHitPolicy,
            PoolName,
            PoolTransfer,
            PoolTransferResult,
        )

        _STAND_IN_WHY = ""
    except ImportError as why:
        from ._hicache_stand_in import (
            HiCacheStorage,
            HiCacheStorageConfig,
            HiCacheStorageExtraInfo,
            PoolHitPolicy,
            PoolName,
            PoolTransfer,
            PoolTransferResult,
        )

        _STAND_IN_WHY = str(why)

#: Which ``HiCacheStorage`` ``KvshardStorage`` subclasses: ``"sglang"`` (SGLang's own, where the
#: ``sglang`` wheel imports) or ``"stand-in"`` (``kvshard._hicache_stand_in``, same signatures).
BASE_CLASS = "sglang" if HiCacheStorage.__module__.startswith("sglang") else "stand-in"

if BASE_CLASS == "sglang":
    logger.info("kvshard.sglang_storage: KvshardStorage subclasses SGLang's HiCacheStorage")
else:
    logger.info(
        "kvshard.sglang_storage: sglang does not import (%s); KvshardStorage subclasses a "
        "stand-in HiCacheStorage with SGLang's signatures",
        _STAND_IN_WHY,
    )

__all__ = [
    "BASE_CLASS",
    "KvshardStorage",
    "adopt_sglang_pools",
    "HiCacheStorage",
    "HiCacheStorageConfig",
    "HiCacheStorageExtraInfo",
    "PoolHitPolicy",
    "PoolName",
    "PoolTransfer",
    "PoolTransferResult",
]

_LEGACY = (
    "KvshardStorage moves whole pages (every component) between the host pool and disk without "
    "a copy; use batch_get_v1/batch_set_v1 (or the v2 calls), SGLang's zero-copy path, not {}"
)


def _mla_of(pool) -> MLAHostPool:
    """The ``MLAHostPool`` a registered SGLang pool stands for (the indexer companion is the
    same kvshard host pool)."""
    if isinstance(pool, MLAHostPool):
        return pool
    if isinstance(pool, DSAIndexerHostPool):
        return pool.mla
    raise kvshard.error.InvalidArgumentError(
        "KvshardStorage stores pages of a kvshard host pool: register a "
        f"kvshard.sglang.MLAHostPool (or its .indexer), not {type(pool).__name__}"
    )


def _index_values(host_indices) -> List[int]:
    """Index values on the host, as Python ints (a CUDA tensor is copied first)."""
    if getattr(host_indices, "is_cuda", False):
        host_indices = host_indices.cpu()
    if hasattr(host_indices, "tolist"):
        host_indices = host_indices.tolist()
    return [operator.index(v) for v in host_indices]


_LATENT_BY_ROW_BYTES = {
    576: kvshard.geometry.LatentLayout.FP8_TRTLLM,
    656: kvshard.geometry.LatentLayout.FP8_SCALED,
    1152: kvshard.geometry.LatentLayout.BF16,
}


def _page_interleave(pool) -> Optional[Tuple[int, int]]:
    """``(shard_rank, shard_size)`` of SGLang's ``PageInterleaveHostPool`` (a facade over a
    native host pool), else None. Its attributes are read without its ``__getattr__``, which
    forwards everything else to the native pool."""
    try:
        attrs = object.__getattribute__(pool, "__dict__")
    except AttributeError:
        return None
    if "host_pool" in attrs and "placement" in attrs and "shard_size" in attrs:
        return int(attrs["shard_rank"]), int(attrs["shard_size"])
    return None


def _is_sglang_indexer(pool) -> bool:
    return not isinstance(pool, DSAIndexerHostPool) and hasattr(pool, "index_k_with_scale_buffer")


def _is_sglang_kv(pool) -> bool:
    return not isinstance(pool, MLAHostPool) and hasattr(pool, "kv_buffer")


def adopt_sglang_pools(kv, indexer=None, device: Optional["kvshard.Device"] = None) -> MLAHostPool:
    """A ``kvshard.sglang.MLAHostPool`` over SGLang's own host pools, without a copy: its MLA
    host pool (``MLATokenToKVPoolHost``: ``kv_buffer``, the packed MTP draft as its tail layers)
    and, for a DSA model, its indexer host pool (``DSAIndexerPoolHost``:
    ``index_k_with_scale_buffer``, its live target layers, then the draft's). The geometry is
    read from them (row bytes give the latent layout; ``_live_target_layers`` the layers with an
    indexer); kvshard then checks every buffer's shape and size against it, so a pool it cannot
    describe is refused, never misread. A DSA model's pool without its indexer pool is refused:
    its pages would be stored without the indexer state. ``device``: the kvshard device of the
    memory (default: the CUDA device of SGLang's device pool when the host memory is pinned,
    else the CPU)."""
    row = int(kv.kv_cache_dim) * int(kv.dtype.itemsize)
    latent = _LATENT_BY_ROW_BYTES.get(row)
    if latent is None:
        raise kvshard.error.InvalidArgumentError(f"SGLang host pool rows of {row} B: no kvshard latent layout")
    target = int(kv.target_layer_num)
    drafts = int(kv.layer_num) - target
    if drafts > 1:
        raise kvshard.error.InvalidArgumentError(f"{drafts} packed draft layers: kvshard holds one")
    device_pool = getattr(kv, "device_pool", None)
    start = int(getattr(device_pool, "start_layer", 0) or 0)
    dsa = getattr(device_pool, "index_head_dim", None) is not None
    if indexer is None:
        if dsa:
            raise kvshard.error.InvalidArgumentError(
                "a DSA model's MLA host pool without its indexer host pool: register it "
                "(register_mem_host_pool_v2(indexer_pool, 'indexer')) before any storage call"
            )
        indexer_layers = [False] * target
    else:
        live = {int(layer) for layer in getattr(indexer, "_live_target_layers", range(start, start + target))}
        indexer_layers = [start + i in live for i in range(target)]
    # The packed draft has an indexer exactly when the model does (its tail indexer layer).
    draft = kvshard.geometry.PoolGeometry(latent, indexer_layers=[indexer is not None]) if drafts else None
    geometry = kvshard.geometry.CacheGeometry(kvshard.geometry.PoolGeometry(latent, indexer_layers=indexer_layers), draft)
    if device is None:
        where = str(getattr(device_pool, "device", "cpu"))
        if getattr(kv, "pin_memory", False) and where.startswith("cuda"):
            device = kvshard.Device.cuda(int(where.split(":")[1]) if ":" in where else 0)
        else:
            device = kvshard.Device.cpu()
    buffers = [kv.kv_buffer] + ([indexer.index_k_with_scale_buffer] if indexer is not None else [])
    return MLAHostPool(
        device,
        geometry,
        int(kv.page_num),
        kv.layout,
        "direct" if kv.layout == "page_first_direct" else "kernel",
        packed_draft=True,
        buffers=buffers,
    )


#: A page of a page-interleave host pool that another rank of the shard group owns: this rank
#: neither stores nor loads it, and answers True for it (its owner answers for its bytes).
NOT_MINE = -1

#: Upper bounds on ``extra_config``'s numbers: a value past them is a typo or a unit mistake,
#: refused with a message naming the key before anything is opened (kvshard's store would refuse
#: some of them too, later and less clearly).
MAX_WRITERS = 4096
MAX_SLOTS = 1 << 32
MAX_STAGING_SLOTS = 1 << 16
MAX_TIMEOUT = 3600.0


def _bounded(extra: Dict[str, Any], key: str, default: Optional[int], low: int, high: int) -> int:
    """``extra[key]`` (or ``default``) as an int in ``[low, high]``, else InvalidArgumentError."""
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) and not (isinstance(value, str) and value.strip().isdigit()):
        raise kvshard.error.InvalidArgumentError(f"KvshardStorage extra_config {key!r}={value!r}: expected an integer")
    n = int(value)
    if not low <= n <= high:
        raise kvshard.error.InvalidArgumentError(
            f"KvshardStorage extra_config {key!r}={n}: expected {low} <= {key} <= {high}"
        )
    return n


def _bounded_seconds(extra: Dict[str, Any], key: str, default: float) -> float:
    """``extra[key]`` (or ``default``) as a finite number of seconds in ``(0, MAX_TIMEOUT]``."""
    value = extra.get(key, default)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise kvshard.error.InvalidArgumentError(f"KvshardStorage extra_config {key!r}={value!r}: expected seconds") from None
    if not 0 < seconds <= MAX_TIMEOUT:  # NaN fails too
        raise kvshard.error.InvalidArgumentError(
            f"KvshardStorage extra_config {key!r}={value!r}: expected 0 < {key} <= {MAX_TIMEOUT:g} seconds"
        )
    return seconds


class KvshardStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` on a kvshard ``DiskStore`` (the module docstring says how to
    load it and what it guarantees)."""

    def __init__(self, storage_config, kwargs: Optional[Dict[str, Any]] = None):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.storage_config = storage_config
        self.kwargs = dict(kwargs or {})
        if not storage_config.is_mla_model:
            raise kvshard.error.InvalidArgumentError(
                "KvshardStorage stores MLA (DSA) caches held by a kvshard.sglang.MLAHostPool; "
                "this model is not MLA"
            )
        for required in ("dir", "slots"):
            if required not in extra:
                raise kvshard.error.InvalidArgumentError(
                    f"KvshardStorage needs '{required}' in --hicache-storage-backend-extra-config"
                )
        dir_ = str(extra["dir"])
        tenant = str(extra.get("tenant", ""))
        if storage_config.pp_size > 1:
            # Each stage holds other layers: its own directory (other slot sizes) and namespace
            # (two stages of equal layer counts would otherwise share keys).
            dir_ = os.path.join(dir_, f"pp{storage_config.pp_rank}")
            tenant = f"{tenant}/pp{storage_config.pp_rank}of{storage_config.pp_size}"
        scale = str(extra.get("indexer_scale", "ue8m0")).lower()
        scales = {"ue8m0": kvshard.storage.IndexerScale.UE8M0, "plain": kvshard.storage.IndexerScale.PLAIN}
        if scale not in scales:
            raise kvshard.error.InvalidArgumentError(
                f"indexer_scale {scale!r}: expected 'ue8m0' or 'plain'"
            )
        tp_rank, tp_size = storage_config.tp_rank, storage_config.tp_size
        dp_rank = getattr(storage_config, "dp_rank", 0)
        dp_size = getattr(storage_config, "dp_size", 1)
        self.dir = dir_
        cp_rank, cp_size = storage_config.attn_cp_rank, storage_config.attn_cp_size
        self.slots = _bounded(extra, "slots", None, 1, MAX_SLOTS)
        self.tenant = tenant.encode()
        self.indexer_scale = scales[scale]
        # One file per (attention DP, CP, TP) rank: under CP sharding each CP rank writes the
        # pages it owns (docs/sglang.md, "Each rank stores its own stripe").
        self.writers = _bounded(extra, "writers", dp_size * cp_size * tp_size, 1, MAX_WRITERS)
        self.writer = _bounded(
            extra, "writer", (dp_rank * cp_size + cp_rank) * tp_size + tp_rank, 0, self.writers - 1
        )
        self.staging_slots = _bounded(extra, "staging_slots", 32, 1, MAX_STAGING_SLOTS)
        self.timeout = _bounded_seconds(extra, "timeout", 30.0)
        # (rank, shard size) once SGLang's page-interleave host pool is registered: host indices
        # are then logical, and this rank moves only the pages it owns.
        self._shard: Optional[Tuple[int, int]] = None
        self.store: Optional[kvshard.storage.DiskStore] = None
        self.namespace: Optional[kvshard.storage.Namespace] = None
        self._mla: Optional[MLAHostPool] = None
        # SGLang's own pools, adopted (wrapped, no copy) at the first storage call.
        self._sglang: Dict[str, Any] = {}
        # SGLang's prefetch and backup threads may make that first call together: one store
        # per rank (two would both append to this rank's journal).
        self._opening = threading.RLock()
        self.registered_pools: Dict[Any, Any] = {}

    # --- pools -----------------------------------------------------------------------------

    def _open(self, pool) -> MLAHostPool:
        """Opens the store over ``pool``'s kvshard host pool on first use; later pools must be
        the same host pool (one slot holds every component of one host page)."""
        mla = _mla_of(pool)
        with self._opening:
            return self._open_locked(mla)

    def _open_locked(self, mla: MLAHostPool) -> MLAHostPool:
        if self._mla is None:
            if not hasattr(kvshard.storage, "DiskStore"):
                raise kvshard.error.UnavailableError(
                    "this kvshard build has no storage tier (build the wheel with --features nixl)"
                )
            store = kvshard.storage.DiskStore(
                mla.host,
                self.dir,
                self.slots,
                writer=self.writer,
                writers=self.writers,
                staging_slots=self.staging_slots,
                timeout=self.timeout,
            )
            self.namespace = kvshard.storage.Namespace(mla.geometry, self.tenant, self.indexer_scale)
            self._mla = mla
            # Last: other threads take a store that is not None as ready.
            self.store = store
            logger.info(
                "KvshardStorage: %s, writer %d of %d, %d slots of %d B, %s",
                self.dir,
                self.writer,
                self.writers,
                self.slots,
                store.slot_bytes,
                store.io_queue,
            )
        elif mla.host is not self._mla.host:
            raise kvshard.error.InvalidArgumentError(
                "KvshardStorage: every registered pool must be over the same kvshard host pool "
                "(one slot holds every component of a host page)"
            )
        return mla

    def _register(self, pool) -> None:
        """Opens the store over a kvshard pool now, or keeps SGLang's own pool to adopt at the
        first storage call (its indexer pool may be registered after it). SGLang's
        page-interleave host pool (``PageInterleaveHostPool``) is its native pool behind an
        owner-classed slot allocator: the native pool's buffers are this rank's physical pages, and
        the host indices of every later call are logical (page ``h`` is rank ``h % N``'s local page
        ``h // N``)."""
        shard = _page_interleave(pool)
        if shard is not None:
            if self._shard is not None and self._shard != shard:
                raise kvshard.error.InvalidArgumentError(
                    f"KvshardStorage: page-interleave pools of rank/size {self._shard} and {shard}"
                )
            self._shard = shard
            pool = object.__getattribute__(pool, "host_pool")
        if _is_sglang_kv(pool) or _is_sglang_indexer(pool):
            role = "indexer" if _is_sglang_indexer(pool) else "kv"
            known = self._sglang.get(role)
            if known is not None and known is not pool:
                raise kvshard.error.InvalidArgumentError(
                    f"KvshardStorage: a second SGLang {role} host pool (one slot holds every "
                    "component of one host page: packed drafts only)"
                )
            if self.store is not None and known is None:
                raise kvshard.error.InvalidArgumentError(
                    f"KvshardStorage: SGLang's {role} host pool registered after the store opened"
                )
            self._sglang[role] = pool
        else:
            self._open(pool)

    def _ensure_open(self) -> bool:
        """Whether the store is open, adopting SGLang's registered pools first if needed (a
        failure is logged: SGLang's storage threads do not survive exceptions)."""
        if self.store is not None:
            return True
        with self._opening:
            if self.store is None and "kv" in self._sglang:
                try:
                    self._open(adopt_sglang_pools(self._sglang["kv"], self._sglang.get("indexer")))
                except kvshard.KvshardError as e:
                    logger.error("KvshardStorage: cannot use SGLang's host pools: %s", e)
        return self.store is not None

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """SGLang's host pool: a ``kvshard.sglang.MLAHostPool`` (the store opens over it), or
        SGLang's own ``MLATokenToKVPoolHost`` (wrapped with its indexer pool, without a copy, at
        the first storage call: ``adopt_sglang_pools``)."""
        super().register_mem_pool_host(mem_pool_host)
        self._register(mem_pool_host)
        self.registered_pools.setdefault(PoolName.KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """A named pool of the v2 calls (``"kv"``, ``"indexer"``, ``"draft"``, ...): the
        ``MLAHostPool`` or its ``.indexer``, or SGLang's own MLA and DSA indexer host pools
        (the packed draft is in the MLA one), all over one host pool."""
        self._register(host_pool)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _held(self, name) -> bool:
        """Whether pool ``name`` is registered (and so over this store's host pool)."""
        return name in self.registered_pools

    # --- keys and pages --------------------------------------------------------------------

    def _key(self, key: str) -> Optional[bytes]:
        """The storage key of SGLang's hex page hash, or None for a string that is not one."""
        assert self.namespace is not None
        try:
            return self.namespace.key(key)
        except kvshard.error.InvalidArgumentError:
            return None

    def _pages(self, keys: List[str], host_indices) -> Optional[List[Optional[int]]]:
        """Per key, its local host page, ``NOT_MINE`` for a page another rank of the shard group
        owns (page-interleave pools), or None for one that is not usable; None when the indices
        do not cover the keys."""
        pages = self._logical_pages(keys, host_indices)
        if pages is None or self._shard is None:
            return pages
        rank, size = self._shard
        assert self._mla is not None
        limit = self._mla.host.pages
        out: List[Optional[int]] = []
        for p in pages:
            if p is None or p % size != rank:
                out.append(None if p is None else NOT_MINE)
            else:
                local = p // size
                out.append(local if 0 < local < limit else None)
        return out

    def _logical_pages(self, keys: List[str], host_indices) -> Optional[List[Optional[int]]]:
        """Per key, its host page (whole, aligned pages of the token indices; None for one that
        is not, or that is the padding page 0 or past the pool, so that it alone fails), or None
        when the indices do not cover the keys."""
        assert self._mla is not None
        limit = self._mla.host.pages * (self._shard[1] if self._shard is not None else 1)
        values = _index_values(host_indices)
        if len(values) != len(keys) * PAGE_SIZE:
            logger.error(
                "KvshardStorage: %d host indices for %d pages of %d", len(values), len(keys), PAGE_SIZE
            )
            return None
        pages: List[Optional[int]] = []
        for i in range(len(keys)):
            run = values[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]
            start = run[0]
            whole = start % PAGE_SIZE == 0 and run == list(range(start, start + PAGE_SIZE))
            usable = whole and 0 < start // PAGE_SIZE < limit
            pages.append(start // PAGE_SIZE if usable else None)
        return pages

    def _move(self, store: bool, entries: List[List[Tuple[str, Optional[int]]]]) -> List[List[bool]]:
        """Stores or loads every distinct ``(key, page)`` of ``entries`` (one list per pool)
        once, and answers per entry. A key named with two host pages, an invalid key or page,
        or a kvshard error, is a failure for those entries, with nothing moved for them."""
        assert self.store is not None
        where: Dict[bytes, Optional[int]] = {}
        for pool in entries:
            for key, page in pool:
                k = self._key(key)
                if k is None or page is None or page == NOT_MINE:
                    continue
                if where.setdefault(k, page) != page:
                    where[k] = None
        items = [(k, p) for k, p in where.items() if p is not None]
        ok: Dict[bytes, bool] = {}
        try:
            if store:
                report = self.store.store_sync(items)
                if report.dropped:
                    present = self.store.exists([k for k, _ in items], self.store.snapshot())
                    ok = {k: hit for (k, _), hit in zip(items, present)}
                else:
                    ok = {k: True for k, _ in items}
            else:
                self.store.snapshot()
                outcomes = self.store.load_sync(items)
                ok = {k: o == kvshard.storage.LoadOutcome.LOADED for (k, _), o in zip(items, outcomes)}
        except kvshard.KvshardError as e:
            logger.error("KvshardStorage: %s of %d pages failed: %s", "store" if store else "load", len(items), e)
            ok = {}

        def answer(key: str, page: Optional[int]) -> bool:
            k = self._key(key)
            if page == NOT_MINE:
                # Another rank of the shard group owns it and moves it: nothing to do here.
                return k is not None
            return k is not None and page is not None and where.get(k) == page and ok.get(k, False)

        return [[answer(key, page) for key, page in pool] for pool in entries]

    def _v1(self, store: bool, keys: List[str], host_indices) -> List[bool]:
        if not self._ensure_open():
            logger.error("KvshardStorage: no host pool registered")
            return [False] * len(keys)
        pages = self._pages(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        return self._move(store, [list(zip(keys, pages))])[0]

    # --- v1 --------------------------------------------------------------------------------

    def batch_set_v1(self, keys: List[str], host_indices, extra_info=None) -> List[bool]:
        """Stores the host pages of ``host_indices`` (64 token indices per page) under SGLang's
        page hashes ``keys``: per key, whether the page is in storage afterwards (already
        there counts)."""
        return self._v1(True, keys, host_indices)

    def batch_get_v1(self, keys: List[str], host_indices, extra_info=None) -> List[bool]:
        """Loads the pages of ``keys`` into the host pages of ``host_indices``: per key, whether
        its bytes landed (a missing, torn or corrupted page is False, its host page untouched)."""
        return self._v1(False, keys, host_indices)

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        """How many leading ``keys`` are present (a prefix chain), as of a fresh snapshot (an
        error of the store is logged and answers 0)."""
        if not self._ensure_open():
            return 0
        prefix: List[bytes] = []
        for key in keys:
            k = self._key(key)
            if k is None:
                break
            prefix.append(k)
        if not prefix:
            return 0
        assert self.store is not None
        try:
            return self.store.lookup(prefix, self.store.snapshot())
        except kvshard.KvshardError as e:
            logger.error("KvshardStorage: lookup of %d pages failed: %s", len(prefix), e)
            return 0

    def exists(self, key: str) -> bool:
        """Whether the page of ``key`` is present."""
        return self.batch_exists([key]) == 1

    # --- v2 --------------------------------------------------------------------------------

    def batch_exists_v2(self, keys: List[str], pool_transfers=None, extra_info=None):
        """The usable prefix of ``keys`` over the KV pool and every extra pool of
        ``pool_transfers``. One slot holds every component of a page, so a registered pool has
        a page exactly when the KV pool does (under either hit policy); a pool that is not
        registered has none."""
        kv_pages = self.batch_exists(keys, extra_info)
        hits: Dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        final = kv_pages
        for transfer in pool_transfers or []:
            if final == 0:
                break
            boundary = kv_pages if self._held(transfer.name) else 0
            if not boundary:
                logger.warning("KvshardStorage: pool %s is not registered: no hits", transfer.name)
            else:
                hits[transfer.name] = boundary
            final = min(final, boundary)
        return PoolTransferResult(final, hits)

    def _v2(self, store: bool, transfers) -> Dict[Any, List[bool]]:
        names: List[Any] = []
        entries: List[List[Tuple[str, Optional[int]]]] = []
        usable: List[bool] = []
        if not self._ensure_open():
            return {t.name: [False] * len(t.keys or []) for t in transfers}
        for t in transfers:
            keys: List[str] = list(t.keys or [])
            pages: Optional[List[Optional[int]]] = None
            if self._held(t.name) and t.host_indices is not None:
                pages = self._pages(keys, t.host_indices)
            names.append(t.name)
            usable.append(pages is not None)
            entries.append(list(zip(keys, pages or [None] * len(keys))))
        moved = self._move(store, [e if u else [] for e, u in zip(entries, usable)])
        return {
            n: (m if u else [False] * len(e)) for n, e, u, m in zip(names, entries, usable, moved)
        }

    def batch_get_v2(self, transfers, extra_info=None) -> Dict[Any, List[bool]]:
        """Loads every transfer's pages (per pool name, per key whether it landed). Each
        distinct page is read once: its slot brings every component, so the transfers of a page
        must name the same host page (another one is a failure, nothing moved)."""
        return self._v2(False, transfers)

    def batch_set_v2(self, transfers, extra_info=None) -> Dict[Any, List[bool]]:
        """Stores every transfer's pages (per pool name, per key whether it is in storage
        afterwards); each distinct page is written once, with every component."""
        return self._v2(True, transfers)

    # --- legacy per-tensor calls -----------------------------------------------------------

    def get(self, key, target_location=None, target_sizes=None):
        """Not offered: raises ``NotImplementedError`` naming the zero-copy calls."""
        raise NotImplementedError(_LEGACY.format("get"))

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """Not offered: raises ``NotImplementedError`` naming the zero-copy calls."""
        raise NotImplementedError(_LEGACY.format("batch_get"))

    def set(self, key, value=None, target_location=None, target_sizes=None):
        """Not offered: raises ``NotImplementedError`` naming the zero-copy calls."""
        raise NotImplementedError(_LEGACY.format("set"))

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        """Not offered: raises ``NotImplementedError`` naming the zero-copy calls."""
        raise NotImplementedError(_LEGACY.format("batch_set"))

    # --- housekeeping ----------------------------------------------------------------------

    def clear(self) -> bool:
        """Not done while serving: the files are shared by every rank and crash-safe by their
        journals, so one rank cannot drop them under the others. Returns False (SGLang's
        convention for a clear that did not happen); stop every rank and remove ``dir``."""
        logger.warning(
            "KvshardStorage.clear: the store in %s is shared by %d ranks; stop them all and "
            "remove the directory to clear it",
            self.dir,
            self.writers,
        )
        return False

    def get_stats(self) -> Optional[Dict[str, Any]]:
        """kvshard's counters (pages stored, loaded, corrupt, evicted; I/Os posted), the slots
        in use, the slot size and the kernel queue, or None before a host pool is registered."""
        if self.store is None:
            return None
        stats: Dict[str, Any] = self.store.stats().as_dict()
        stats.update(
            used_slots=self.store.used_slots,
            slots=self.slots,
            slot_bytes=self.store.slot_bytes,
            io_queue=self.store.io_queue,
            base_class=BASE_CLASS,
        )
        return stats
