"""The cache's shape (Rust: ``kvshard::geometry``): a model's layers and components, their row
layouts and the fixed sizes of a page."""

from . import _home
from ._kvshard import (
    INDEXER_HEAD_DIM,
    INDEXER_PAGE_BYTES,
    INDEXER_ROW_BYTES,
    KV_LORA_RANK,
    PAGE_SIZE,
    ROPE_DIM,
    CacheGeometry,
    Component,
    ComponentLayout,
    LatentLayout,
    PoolGeometry,
)

__all__ = [
    "CacheGeometry",
    "PoolGeometry",
    "ComponentLayout",
    "LatentLayout",
    "Component",
    "PAGE_SIZE",
    "INDEXER_PAGE_BYTES",
    "INDEXER_ROW_BYTES",
    "KV_LORA_RANK",
    "ROPE_DIM",
    "INDEXER_HEAD_DIM",
]

_home.settle(__name__, __all__, globals())
