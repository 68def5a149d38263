"""kvshard: the page-sharded FP8 KV-cache data plane for DSA models (GLM-5, DeepSeek-V3.2),
inside Python serving engines.

The classes wrap kvshard's Rust API (see the README): ``CacheGeometry`` (with the
``deepseek_v32()`` and ``glm5()`` presets), ``Placement`` and the rotated ``ShardAllocator``,
``RequestChain``, ``Budget``, ``DevicePool`` (allocated, or wrapping the engine's tensors
through DLPack with no copy) and ``OwnedRowWrite``, P/D ``Sender``/``Receiver`` with
``RemoteSpace``, ``HostPool`` (kvshard's and SGLang's byte layouts), ``TransferPlan``,
``HostTransfer`` and ``HiCacheController``. ``kvshard.sglang.MLAHostPool`` offers SGLang's
host pool interface on top.

Work runs on a ``Device``: ``Device.cpu()`` (the reference twin of every kernel, NumPy arrays
as tensors) or ``Device.cuda(0)`` (torch/CuPy/JAX tensors). Every enqueueing call takes the
caller's stream (``None``, a ``kvshard.Stream``, an int ``CUstream``, a ``torch.cuda.Stream``;
``None`` is torch's current stream on a GPU when torch is in use) and never synchronizes it
behind the caller's back; ``after=`` also takes ``torch.cuda.Event``. Long calls release the
GIL. Memory kvshard writes into must be writable (``ReadOnlyError`` otherwise), and wrapped
NumPy arrays cannot be resized while their pool lives.
"""

from . import _errors
from ._errors import (
    ChunkFailedError,
    DriverError,
    HiCacheError,
    InvalidArgumentError,
    KvshardError,
    OutOfMemoryError,
    ReadOnlyError,
    TransferError,
    UnavailableError,
)
from ._kvshard import (
    DEFAULT_STAGING_PAGES,
    INDEXER_HEAD_DIM,
    INDEXER_PAGE_BYTES,
    INDEXER_ROW_BYTES,
    KV_LORA_RANK,
    MAX_PREFILL_RANKS,
    PAGE_SIZE,
    ROPE_DIM,
    Allocation,
    BackupAck,
    Budget,
    CacheGeometry,
    CacheNode,
    ChunkStaging,
    ChunkStatus,
    Component,
    ComponentLayout,
    Device,
    DevicePool,
    Event,
    Finished,
    HiCacheController,
    HostBufferLayout,
    HostLayout,
    HostPool,
    HostTransfer,
    LatentLayout,
    LayerReady,
    LayerSignals,
    LayerWaits,
    LoadAck,
    LoadHandle,
    OwnedRowWrite,
    PendingChunk,
    Placement,
    PoolGeometry,
    PoolLayout,
    Receiver,
    Registration,
    RemoteSpace,
    RequestChain,
    Sender,
    ShardAllocator,
    StagedIo,
    Stream,
    TensorView,
    TransferPlan,
    driver_present,
    embedded_archs,
)

__version__ = "0.1.0"

__all__ = [name for name in dir() if not name.startswith("_") and name != "annotations"]
