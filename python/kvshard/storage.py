"""The storage tier (docs/storage.md): the keys engines share (Rust: ``kvshard::key``; SGLang's
SHA-256 page chain) and, in a build with the ``nixl`` feature, ``DiskStore`` below the host pool
(Rust: ``kvshard::pool::disk``) with its reports."""

from . import _home
from ._kvshard import (
    KEY_BYTES,
    STORAGE_LAYOUT_VERSION,
    IndexerScale,
    Namespace,
    page_hash,
    page_hashes,
)

__all__ = [
    "Namespace",
    "IndexerScale",
    "page_hash",
    "page_hashes",
    "KEY_BYTES",
    "STORAGE_LAYOUT_VERSION",
]

try:
    from ._kvshard import DiskStats, DiskStore, LoadOutcome, Snapshot, StoreReport
except ImportError:  # built without the `nixl` feature: no storage tier in this wheel
    pass
else:
    __all__ += ["DiskStore", "DiskStats", "LoadOutcome", "Snapshot", "StoreReport"]

_home.settle(__name__, __all__, globals())
