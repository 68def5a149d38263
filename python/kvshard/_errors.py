"""kvshard's exceptions. Every error kvshard raises carries kvshard's own message.

- ``KvshardError``: the base of all of them.
- ``InvalidArgumentError`` (also a ``ValueError``): a bad argument, tensor, geometry, page or
  index, refused before anything moved (or a kernel that rejected an input entry); among them
  a request chain used after one of its pages was freed, or with another allocator than its
  own. ``ReadOnlyError`` is read-only memory handed where kvshard writes.
- ``OutOfMemoryError`` (also a ``MemoryError``): an allocation, a budget or an owner class
  that cannot hold what was asked.
- ``UnavailableError`` (also a ``RuntimeError``): no CUDA driver, no such GPU, a build
  without kernels, or a missing NCCL or NIXL library.
- ``DriverError`` (also a ``RuntimeError``): a CUDA driver (or NCCL) call failed.
- ``TransferError``: a P/D request is invalid or failed; ``ChunkFailedError`` is a chunk that
  failed on this rank (its ``status`` is what to deliver to the decode side);
  ``TransferDeadlineError`` (also a ``TimeoutError``) a request whose deadline passed before
  every prefill rank reported its last status.
- ``HiCacheError``: a HiCache operation is invalid or failed; ``StorageError`` is the storage
  tier's (its files cannot be made, opened or registered, the disk is full, an I/O failed, or
  the files are of another format), with the host and device pools untouched.

Which kvshard error becomes which exception is one exhaustive match in the extension
(``python/src/errors.rs``): a new kind of kvshard error is given its class there before it
builds.
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
    """No CUDA driver, no such GPU, a build without kernels, or no NCCL or NIXL library."""


class DriverError(KvshardError, RuntimeError):
    """A CUDA driver (or NCCL) call failed."""


class TransferError(KvshardError):
    """A P/D transfer request is invalid or failed."""


class ChunkFailedError(TransferError):
    """A chunk failed on this prefill rank, and with it the request.

    Attributes: ``request``, ``rank``, ``chunk``, ``reason``, and ``status`` (a
    ``kvshard.transfer.ChunkStatus`` to deliver to the decode side: the rank's last for the request).
    """

    request: int
    rank: int
    chunk: int
    reason: str

    @property
    def status(self):
        """The failed ``kvshard.transfer.ChunkStatus`` to deliver to the decode side."""
        # Imported here: the native module looks this module up, not the other way round.
        from ._kvshard import ChunkStatus

        return ChunkStatus.failed(self.request, self.rank, self.chunk, self.reason)


class TransferDeadlineError(TransferError, TimeoutError):
    """A P/D request's deadline passed before every prefill rank reported its last status.

    Attributes (those of the ``kvshard.transfer.Overdue`` it stands for): ``request``, ``deadline``
    (seconds from its registration), ``ranks`` (prefill ranks sending it) and ``missing``:
    ``(rank, received)`` of each rank whose last status never came (chunks ``0..received``
    arrived). Abort those ranks; their pages stay held until each has reported.
    """

    request: int
    deadline: float
    ranks: int
    missing: list


class HiCacheError(KvshardError):
    """A HiCache operation is invalid or failed."""


class StorageError(HiCacheError):
    """The storage tier (``DiskStore``) could not do what was asked; nothing in the host or
    device pools was touched.

    Attributes: ``path`` (the file or directory concerned) and ``failure``: ``"full"`` (no room
    on the filesystem), ``"open"`` (a file or the directory cannot be made or opened, or the
    filesystem refuses direct I/O), ``"register"`` (NIXL refused it or has no POSIX backend),
    ``"io"`` (a read, write or sync failed), ``"format"`` (the files there are of another slot
    size, slot count or rank), ``"read_only"`` (a write asked of a store opened read-only),
    ``"untrusted"`` (a symbolic or hard link, or something group- or other-writable or another
    user's, in the store's directory), ``"locked"`` (another store writes this rank in this
    directory: ``holder`` is its process id, or None) or ``"corrupt"`` (a damaged journal
    record with valid ones after it, on a store opened with ``damaged="refuse"``).
    """

    path: str
    failure: str
    holder: "int | None"


__all__ = [
    "KvshardError",
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
