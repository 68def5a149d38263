"""Prefill to decode (P/D; Rust: ``kvshard::transfer``): senders on the prefill ranks, the
decode side's receiver and the statuses between them, a request's registration (and the
decode context-parallel one), deadlines, and the send plans a Mooncake transfer engine runs
(``kvshard.mooncake`` runs P/D on them)."""

from . import _home
from ._kvshard import (
    DEFAULT_DEADLINE,
    MAX_PREFILL_RANKS,
    BounceBuffer,
    ChunkStatus,
    DecodeRank,
    DecodeRegistration,
    Finished,
    MooncakeChunk,
    MooncakeMode,
    MooncakeSender,
    Overdue,
    PendingChunk,
    Receiver,
    Registration,
    Sender,
    engine_memory,
    engine_regions,
)

__all__ = [
    "Sender",
    "PendingChunk",
    "ChunkStatus",
    "Receiver",
    "Finished",
    "Overdue",
    "Registration",
    "DecodeRank",
    "DecodeRegistration",
    "DEFAULT_DEADLINE",
    "MAX_PREFILL_RANKS",
    "MooncakeSender",
    "MooncakeChunk",
    "MooncakeMode",
    "BounceBuffer",
    "engine_memory",
    "engine_regions",
]

_home.settle(__name__, __all__, globals())
