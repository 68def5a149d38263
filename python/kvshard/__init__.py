"""kvshard: the page-sharded FP8 KV-cache data plane for DSA models (GLM-5, DeepSeek-V3.2),
inside Python serving engines (docs/python.md).

The top of the package holds what every flow starts from: ``Device`` (``Device.cpu()``, the
reference twin of every kernel with NumPy arrays as tensors, or ``Device.cuda(0)``),
``KvshardError`` (the base of every kvshard error), ``host_waits()`` (the calling thread's host
waits: only ``_sync`` calls and ``synchronize`` block) and ``__version__``. Everything else is in
one submodule by job, named for the Rust module it wraps:

- ``kvshard.geometry``: the cache's shape (``CacheGeometry``, ``PoolGeometry``, ``Component``...);
- ``kvshard.shard``: pages across ranks (``Placement``, ``ShardAllocator``, ``RequestChain``,
  ``DecodeLayout``...);
- ``kvshard.pool``: device and host pools, the chunk staging and its write, budgets, capacity;
- ``kvshard.copy``: how bytes move (``Method``, ``Direction``, ``RemoteSpace``, ``PageCopy``);
- ``kvshard.transfer``: P/D (``Sender``, ``Receiver``, ``Registration``, Mooncake send plans);
- ``kvshard.hicache``: the ``HiCacheController``, host transfers and load readiness;
- ``kvshard.storage``: storage keys and, with the ``nixl`` feature, ``DiskStore``;
- ``kvshard.backend``: streams, events, ``TensorView`` and deferred frees;
- ``kvshard.error``: the exceptions below ``KvshardError``.

Imported on their own: ``kvshard.sglang`` (SGLang's host pool interface and data-plane adapter),
``kvshard.sglang_storage`` (SGLang's ``HiCacheStorage``) and ``kvshard.mooncake`` (P/D over
Mooncake's transfer engine).

The flat names of kvshard 0.1 (``kvshard.DevicePool``...) still resolve at run time, to the
same objects, with a ``DeprecationWarning`` naming the submodule; they are not part of the typed
surface.
"""

import typing as _typing

from . import _home, backend, copy, error, geometry, hicache, pool, shard, storage, transfer
from ._errors import KvshardError
from ._kvshard import Device, host_waits

__version__ = "0.1.0"

__all__ = [
    "Device",
    "KvshardError",
    "host_waits",
    "backend",
    "copy",
    "error",
    "geometry",
    "hicache",
    "pool",
    "shard",
    "storage",
    "transfer",
]
_home.settle(__name__, __all__, globals())

# The submodules that hold kvshard 0.1's flat names (each name in exactly one of them).
_HOMES = (geometry, shard, pool, copy, transfer, hicache, storage, backend, error)

if not _typing.TYPE_CHECKING:
    # Hidden from type checkers, so typed code uses the submodules and only old code at run
    # time reaches this.

    def __getattr__(name):
        """A flat name of kvshard 0.1 (a public name of the extension or an exception): the same
        object from its submodule, with a warning."""
        import warnings

        from . import _errors, _kvshard

        if name.startswith("_") or (name not in _kvshard.__all__ and name not in _errors.__all__):
            raise AttributeError(f"module 'kvshard' has no attribute {name!r}")
        home = next((module for module in _HOMES if name in module.__all__), None)
        if home is None:  # the Mooncake side channel's names
            from . import mooncake as home
        warnings.warn(f"kvshard.{name} is {home.__name__}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(home, name)
