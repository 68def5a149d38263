"""kvshard: the page-sharded FP8 KV-cache data plane for DSA models (GLM-5, DeepSeek-V3.2),
inside Python serving engines.

The classes wrap kvshard's Rust API (see the README): ``CacheGeometry`` (with the
``deepseek_v32()`` and ``glm5()`` presets), ``Placement`` and the rotated ``ShardAllocator``,
``RequestChain``, ``Budget``, ``DevicePool`` (allocated, or wrapping the engine's tensors
through DLPack with no copy) and ``OwnedRowWrite``, P/D ``Sender``/``Receiver`` with
``RemoteSpace``, ``HostPool`` (kvshard's and SGLang's byte layouts), ``TransferPlan``,
``HostTransfer`` and ``HiCacheController``; decode servers sharded by token (decode context
parallelism): ``DecodeLayout`` (vLLM's and SGLang's DCP parameters by their names),
``DecodeRank`` and ``DecodeRegistration``, opened with ``Sender.open_decode``;
``MooncakeSender`` hands send plans out as a transfer
engine's (source, destination, length) lists, and ``kvshard.mooncake`` runs P/D on Mooncake's
transfer engine with them. ``kvshard.sglang.MLAHostPool`` offers SGLang's
host pool interface on top. Storage keys engines share: ``Namespace``, ``page_hash`` and
``page_hashes`` (SGLang's SHA-256 page chain); with the ``nixl`` feature, the storage tier below
the host pool, ``DiskStore``, and ``kvshard.sglang_storage.KvshardStorage``, SGLang's
``HiCacheStorage`` on top of it. Choices are enum classes, never strings: ``LatentLayout``,
``Component``, ``HostLayout``, ``Route``, ``WritePolicy``, ``Direction``, and ``Method``, how
bytes move on every route (P/D senders, HiCache transfers and their staged relayouts).

Work runs on a ``Device``: ``Device.cpu()`` (the reference twin of every kernel, NumPy arrays
as tensors) or ``Device.cuda(0)`` (torch/CuPy/JAX tensors). Every enqueueing call takes the
caller's stream (``None``, a ``kvshard.Stream``, an int ``CUstream``, a ``torch.cuda.Stream``;
``None`` is torch's current stream on a GPU when torch is in use) and never synchronizes it
behind the caller's back; ``after=`` also takes ``torch.cuda.Event``. Long calls release the
GIL. Memory kvshard writes into must be writable (``ReadOnlyError`` otherwise), and wrapped
NumPy arrays cannot be resized while their pool lives. Nothing P/D waits forever: the
``Receiver``'s ``expire()`` reports each request whose deadline passed, and the ``Sender``'s
``take_dropped()`` the failure of each chunk dropped before its status was taken.
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
    StorageError,
    TransferDeadlineError,
    TransferError,
    UnavailableError,
)
from ._kvshard import (
    DEFAULT_DEADLINE,
    DEFAULT_STAGING_PAGES,
    INDEXER_HEAD_DIM,
    INDEXER_PAGE_BYTES,
    INDEXER_ROW_BYTES,
    KEY_BYTES,
    KV_LORA_RANK,
    MAX_PREFILL_RANKS,
    PAGE_SIZE,
    ROPE_DIM,
    STORAGE_LAYOUT_VERSION,
    # A CP prefill batch's admission and gather plan.
    Admission,
    GatherPlan,
    # A page copy an engine's scratch gather runs layer by layer.
    PageCopy,
    Allocation,
    BackupAck,
    Budget,
    CacheGeometry,
    CacheNode,
    CapacityPlan,
    ChunkStaging,
    ChunkStatus,
    Component,
    ComponentLayout,
    Device,
    DevicePool,
    Direction,
    Event,
    Finished,
    HiCacheController,
    HostBufferLayout,
    HostLayout,
    HostPool,
    HostTransfer,
    IndexerScale,
    LatentLayout,
    LayerReady,
    LayerSignals,
    LayerWaits,
    LoadAck,
    LoadHandle,
    BounceBuffer,
    Method,
    MooncakeChunk,
    MooncakeMode,
    MooncakeSender,
    Namespace,
    Overdue,
    OwnedRowWrite,
    PendingChunk,
    Placement,
    PoolGeometry,
    PoolLayout,
    Receiver,
    Registration,
    Reload,
    RemoteSpace,
    RequestChain,
    Route,
    Sender,
    ShardAllocator,
    StagedIo,
    Stream,
    TensorView,
    TierCapacity,
    TierReload,
    TransferPlan,
    WritePolicy,
    driver_present,
    # Decode context parallelism (docs/dcp.md).
    MAX_DECODE_RANKS,
    DecodeLayout,
    DecodeRank,
    DecodeRegistration,
    embedded_archs,
    engine_memory,
    engine_regions,
    page_hash,
    page_hashes,
    plan_capacity,
)

# The process's pending frees.
from ._kvshard import pending_frees, wait_for_frees_sync

# The calling thread's host-blocking waits (only `_sync` calls and `synchronize` block).
from ._kvshard import host_waits

__version__ = "0.1.0"

__all__ = [
    "ChunkFailedError",
    "DriverError",
    "HiCacheError",
    "InvalidArgumentError",
    "KvshardError",
    "OutOfMemoryError",
    "ReadOnlyError",
    "StorageError",
    "TransferDeadlineError",
    "TransferError",
    "UnavailableError",
    "DEFAULT_DEADLINE",
    "DEFAULT_STAGING_PAGES",
    "INDEXER_HEAD_DIM",
    "INDEXER_PAGE_BYTES",
    "INDEXER_ROW_BYTES",
    "KEY_BYTES",
    "KV_LORA_RANK",
    "MAX_PREFILL_RANKS",
    "PAGE_SIZE",
    "ROPE_DIM",
    "STORAGE_LAYOUT_VERSION",
    "Admission",
    "GatherPlan",
    "PageCopy",
    "Allocation",
    "BackupAck",
    "Budget",
    "CacheGeometry",
    "CacheNode",
    "CapacityPlan",
    "ChunkStaging",
    "ChunkStatus",
    "Component",
    "ComponentLayout",
    "Device",
    "DevicePool",
    "Direction",
    "Event",
    "Finished",
    "HiCacheController",
    "HostBufferLayout",
    "HostLayout",
    "HostPool",
    "HostTransfer",
    "IndexerScale",
    "LatentLayout",
    "LayerReady",
    "LayerSignals",
    "LayerWaits",
    "LoadAck",
    "LoadHandle",
    "BounceBuffer",
    "Method",
    "MooncakeChunk",
    "MooncakeMode",
    "MooncakeSender",
    "Namespace",
    "Overdue",
    "OwnedRowWrite",
    "PendingChunk",
    "Placement",
    "PoolGeometry",
    "PoolLayout",
    "Receiver",
    "Registration",
    "Reload",
    "RemoteSpace",
    "RequestChain",
    "Route",
    "Sender",
    "ShardAllocator",
    "StagedIo",
    "Stream",
    "TensorView",
    "TierCapacity",
    "TierReload",
    "TransferPlan",
    "WritePolicy",
    "driver_present",
    "embedded_archs",
    "pending_frees",
    "wait_for_frees_sync",
    "host_waits",
    "engine_memory",
    "engine_regions",
    "page_hash",
    "page_hashes",
    "plan_capacity",
    # Decode context parallelism (docs/dcp.md).
    "MAX_DECODE_RANKS",
    "DecodeLayout",
    "DecodeRank",
    "DecodeRegistration",
]

# The Mooncake side channel's frames and its decode side (what kvshard.mooncake runs on).
from ._kvshard import MooncakeReceiver, SideReader, side_frame, side_shape  # noqa: E402

__all__ += ["MooncakeReceiver", "SideReader", "side_frame", "side_shape"]

try:
    from ._kvshard import DiskStats, DiskStore, LoadOutcome, Snapshot, StoreReport
except ImportError:  # built without the `nixl` feature: no storage tier in this wheel
    pass
else:
    __all__ += ["DiskStats", "DiskStore", "LoadOutcome", "Snapshot", "StoreReport"]
