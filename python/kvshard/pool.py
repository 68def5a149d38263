"""The memory the cache lives in (Rust: ``kvshard::pool``): device pools (allocated, or wrapping
the engine's tensors), the chunk staging and the write of a chunk's rows into its pages, host
pools (kvshard's and SGLang's byte layouts), budgets and the capacity planner."""

from . import _home
from ._kvshard import (
    Budget,
    CapacityPlan,
    ChunkStaging,
    DevicePool,
    HostBufferLayout,
    HostLayout,
    HostPool,
    OwnedRowWrite,
    PoolLayout,
    Reload,
    TierCapacity,
    TierReload,
    plan_capacity,
)

__all__ = [
    "DevicePool",
    "ChunkStaging",
    "OwnedRowWrite",
    "PoolLayout",
    "HostPool",
    "HostLayout",
    "HostBufferLayout",
    "Budget",
    "plan_capacity",
    "CapacityPlan",
    "TierCapacity",
    "TierReload",
    "Reload",
]

_home.settle(__name__, __all__, globals())
