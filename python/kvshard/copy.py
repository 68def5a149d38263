"""How bytes move (Rust: ``kvshard::copy``): the copy method every route takes (P/D senders,
HiCache transfers and their staged relayouts), the direction of a host-device copy, a
destination space of pages (``RemoteSpace``) and a page copy into one, run layer by layer."""

from . import _home
from ._kvshard import Direction, Method, PageCopy, RemoteSpace

__all__ = ["Method", "Direction", "RemoteSpace", "PageCopy"]

_home.settle(__name__, __all__, globals())
