"""The hierarchical cache (Rust: ``kvshard::hicache``): the controller that backs device pages
up to a host pool and loads them back, its routes and write policies, the acknowledgements and
load handles, the host transfers and their plans, and per-layer readiness of loads."""

from . import _home
from ._kvshard import (
    DEFAULT_STAGING_PAGES,
    BackupAck,
    CacheNode,
    HiCacheController,
    HostTransfer,
    LayerReady,
    LayerSignals,
    LayerWaits,
    LoadAck,
    LoadHandle,
    Route,
    StagedIo,
    TransferPlan,
    WritePolicy,
)

__all__ = [
    "HiCacheController",
    "WritePolicy",
    "Route",
    "CacheNode",
    "BackupAck",
    "LoadAck",
    "LoadHandle",
    "HostTransfer",
    "TransferPlan",
    "StagedIo",
    "LayerSignals",
    "LayerReady",
    "LayerWaits",
    "DEFAULT_STAGING_PAGES",
]

_home.settle(__name__, __all__, globals())
