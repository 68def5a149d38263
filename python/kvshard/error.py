"""kvshard's exceptions by kind (Rust: ``kvshard::error``); their base, ``KvshardError``, is
``kvshard.KvshardError``. What each means: ``kvshard/_errors.py``'s docs and docs/python.md."""

from . import _home
from ._errors import (
    ChunkFailedError,
    DriverError,
    HiCacheError,
    InvalidArgumentError,
    OutOfMemoryError,
    ReadOnlyError,
    StorageError,
    TransferDeadlineError,
    TransferError,
    UnavailableError,
)

__all__ = [
    "InvalidArgumentError",
    "ReadOnlyError",
    "OutOfMemoryError",
    "UnavailableError",
    "DriverError",
    "TransferError",
    "ChunkFailedError",
    "TransferDeadlineError",
    "HiCacheError",
    "StorageError",
]

_home.settle(__name__, __all__, globals())
