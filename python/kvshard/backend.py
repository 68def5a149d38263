"""Where work runs (Rust: ``kvshard::backend``): the caller's streams and events, kvshard's own
memory handed out through DLPack, and the process's deferred frees. ``kvshard.Device`` itself is
at the top of the package, since every flow starts with one."""

from . import _home
from ._kvshard import (
    Event,
    Stream,
    TensorView,
    driver_present,
    embedded_archs,
    pending_frees,
    wait_for_frees_sync,
)

__all__ = [
    "Stream",
    "Event",
    "TensorView",
    "driver_present",
    "embedded_archs",
    "pending_frees",
    "wait_for_frees_sync",
]

_home.settle(__name__, __all__, globals())
