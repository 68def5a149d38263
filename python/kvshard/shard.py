"""Which page lives on which rank (Rust: ``kvshard::shard``, and ``kvshard::chain`` for a
request's pages): the placement of pages across context-parallel prefill ranks, the rotated
allocator, a request's page chain, a CP batch's admission and gather plan, and the decode side's
token sharding (decode context parallelism, docs/dcp.md)."""

from . import _home
from ._kvshard import (
    MAX_DECODE_RANKS,
    Admission,
    Allocation,
    DecodeLayout,
    GatherPlan,
    Placement,
    RequestChain,
    ShardAllocator,
)

__all__ = [
    "Placement",
    "ShardAllocator",
    "Allocation",
    "RequestChain",
    "Admission",
    "GatherPlan",
    "DecodeLayout",
    "MAX_DECODE_RANKS",
]

_home.settle(__name__, __all__, globals())
