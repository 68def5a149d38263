"""The sharded P/D index preparation of SGLang 0.5.23's Mooncake connector on kvshard's plans.

SGLang's prefill ranks of a page-interleaved cache each send only the pages they own: its
connector narrows a chunk's logical pages with ``filter_kv_indices_for_shard_rank``
(``disaggregation/utils.py``) and the final chunk's DSA state pages with
``MooncakeKVManager._prepare_sharded_dsa_indices``. The two functions here take the same
arguments and return the same arrays, computed by ``kvshard.hicache.TransferPlan`` (the owner filter
kvshard plans every rank's share of a transfer with, and its P/D senders' descriptors follow),
so the connector can call them in place of its own. kvshard is stricter: a reserved page (a
logical page below the shard size, every rank's padding page) or a page named twice is an
``InvalidArgumentError``, where SGLang filters whatever it is given.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import kvshard

__all__ = ["filter_kv_indices_for_shard_rank", "prepare_sharded_dsa_indices"]


def _owned(pages: Sequence[int], shard_rank: int, shard_size: int) -> "kvshard.hicache.TransferPlan":
    # The pages paired with themselves: the plan keeps this rank's positions and local pages.
    bound = max(pages, default=0) // shard_size + 1
    return kvshard.hicache.TransferPlan(kvshard.shard.Placement(shard_size), shard_rank, pages, pages, bound, bound)


def filter_kv_indices_for_shard_rank(
    *, kv_indices: Any, index_slice: slice, shard_rank: int, shard_size: int
) -> tuple[Any, Any]:
    """SGLang's ``filter_kv_indices_for_shard_rank``: of a chunk's logical pages ``kv_indices``
    (a NumPy int array, the chunk's positions ``index_slice``), the local pages this rank owns
    (logical page ``l`` is rank ``l % N``'s local page ``l // N``) and their positions, as NumPy
    arrays of ``kv_indices``'s dtype and int64."""
    import numpy as np

    pages = [operator.index(p) for p in np.asarray(kv_indices).reshape(-1)]
    plan = _owned(pages, shard_rank, shard_size)
    start = index_slice.start or 0
    local = np.asarray(plan.device_pages, dtype=np.asarray(kv_indices).dtype)
    positions = np.asarray(plan.positions, dtype=np.int64) + start
    return local, positions


def prepare_sharded_dsa_indices(
    src_indices: Any, dst_indices: Any, *, shard_rank: int, shard_size: int
) -> tuple[Any, Any]:
    """SGLang's ``MooncakeKVManager._prepare_sharded_dsa_indices``: the request's logical state
    pages ``src_indices`` paired with the decode's ``dst_indices`` by position, narrowed to the
    pairs this rank owns: (its local pages, their destination pages), int32 NumPy arrays. Pages
    of unequal counts raise ``InvalidArgumentError``."""
    import numpy as np

    if len(src_indices) != len(dst_indices):
        raise kvshard.error.InvalidArgumentError(
            f"sharded DSA state page count mismatch: prefill={len(src_indices)}, dst={len(dst_indices)}"
        )
    local, positions = filter_kv_indices_for_shard_rank(
        kv_indices=np.asarray(src_indices, dtype=np.int32),
        index_slice=slice(0, len(src_indices)),
        shard_rank=shard_rank,
        shard_size=shard_size,
    )
    return local, np.asarray(dst_indices, dtype=np.int32)[positions]
