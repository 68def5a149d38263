"""kvshard's exceptions. Every error kvshard raises carries kvshard's own message.

- ``KvshardError``: the base of all of them.
- ``InvalidArgumentError`` (also a ``ValueError``): a bad argument, tensor, geometry, page or
  index, refused before anything moved (or a kernel that rejected an input entry).
- ``OutOfMemoryError`` (also a ``MemoryError``): an allocation, a budget or an owner class
  that cannot hold what was asked.
- ``UnavailableError`` (also a ``RuntimeError``): no CUDA driver, no such GPU, or a build
  without kernels.
- ``DriverError`` (also a ``RuntimeError``): a CUDA driver call failed.
- ``TransferError``: a P/D request is invalid or failed; ``ChunkFailedError`` is a chunk that
  failed on this rank (its ``status`` is what to deliver to the decode side).
- ``HiCacheError``: a HiCache operation is invalid or failed.
"""


class KvshardError(Exception):
    """Base of every kvshard error."""


class InvalidArgumentError(KvshardError, ValueError):
    """A bad argument, tensor, geometry, page or index."""


class ReadOnlyError(InvalidArgumentError):
    """A read-only array or tensor (a NumPy array with ``writeable=False``, a memmap opened with
    mode ``"r"``, an array over ``bytes``) handed where kvshard writes: refused before anything
    is written."""


class OutOfMemoryError(KvshardError, MemoryError):
    """An allocation, budget or owner class cannot hold what was asked."""


class UnavailableError(KvshardError, RuntimeError):
    """No CUDA driver, no such GPU, or a build without kernels."""


class DriverError(KvshardError, RuntimeError):
    """A CUDA driver call failed."""


class TransferError(KvshardError):
    """A P/D transfer request is invalid or failed."""


class ChunkFailedError(TransferError):
    """A chunk failed on this prefill rank, and with it the request.

    Attributes: ``request``, ``rank``, ``chunk``, ``reason``, and ``status`` (a
    ``kvshard.ChunkStatus`` to deliver to the decode side).
    """

    request: int
    rank: int
    chunk: int
    reason: str
    status: object


class HiCacheError(KvshardError):
    """A HiCache operation is invalid or failed."""


__all__ = [
    "KvshardError",
    "InvalidArgumentError",
    "ReadOnlyError",
    "OutOfMemoryError",
    "UnavailableError",
    "DriverError",
    "TransferError",
    "ChunkFailedError",
    "HiCacheError",
]
