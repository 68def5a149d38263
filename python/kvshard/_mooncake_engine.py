"""Mooncake's transfer engine, one per process, as ``kvshard.mooncake`` uses it: loaded
(``load_engine_class``), initialized once, each piece of kvshard memory registered once and
reused (``Engine``), local ranges checked against the registrations before a write
(``kvshard.mooncake``'s module docs: Registration)."""

from __future__ import annotations

import bisect

from . import _kvshard as _k
from ._errors import InvalidArgumentError, TransferError, UnavailableError


def load_engine_class():
    """``mooncake.engine.TransferEngine``, or ``UnavailableError`` saying what to install."""
    try:
        from mooncake.engine import TransferEngine  # type: ignore[import-untyped]
    except ImportError as e:  # the wheel, or a system library it needs (libibverbs, libnuma)
        raise UnavailableError(
            "Mooncake's transfer engine does not load: install mooncake-transfer-engine "
            f"(CUDA 12), -cuda13 or -non-cuda, and its system libraries ({e})"
        ) from e
    return TransferEngine


class AlreadyRegisteredError(InvalidArgumentError):
    """Memory handed to ``Engine.register`` overlaps memory the engine has registered (the
    same pool twice, or a part of it): refused before Mooncake is called."""


class NotRegisteredError(InvalidArgumentError):
    """A local range no registration covers, handed to ``Engine.write_sync``, or memory
    handed to ``Engine.unregister`` that is not registered as given: refused before Mooncake
    is called."""


def regions_of(memory) -> list[tuple[int, int]]:
    """The contiguous ``[(address, bytes)]`` of ``memory``: a ``DevicePool``, ``HostPool``,
    ``ChunkStaging`` or ``BounceBuffer`` (``kvshard.transfer.engine_regions``), or an ``(address,
    bytes)`` pair."""
    if isinstance(memory, tuple):
        if len(memory) != 2 or not all(isinstance(x, int) for x in memory) or memory[0] <= 0 or memory[1] <= 0:
            raise InvalidArgumentError(f"memory as a pair is (address, bytes), both positive: {memory!r}")
        return [memory]
    return _k.engine_regions(memory)


def _what(memory) -> str:
    return type(memory).__name__ if not isinstance(memory, tuple) else f"range {memory[0]:#x}+{memory[1]}"


class Engine:
    """One process's Mooncake engine: initialized once (``P2PHANDSHAKE``: no metadata
    server), each piece of memory registered once and reused (module docs: Registration).
    ``max_batch`` bounds the descriptors of one Mooncake batch (``write_sync`` posts longer
    lists in turn: its TCP transport refuses batches of many thousands)."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "", max_batch: int = 512):
        if max_batch < 1:
            raise InvalidArgumentError(f"max_batch ({max_batch}) must be at least 1")
        self.te = load_engine_class()()
        rc = self.te.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}")
        #: What peers name this engine by (its handshake port).
        self.address = f"{hostname}:{self.te.get_rpc_port()}"
        self.protocol = protocol
        self.max_batch = max_batch
        # Registered ranges, sorted and disjoint: starts, and (end, what) by start.
        self._starts: list[int] = []
        self._ranges: dict[int, tuple[int, str]] = {}

    @property
    def regions(self) -> list[tuple[int, int]]:
        """The registered ranges, ``[(address, bytes)]`` in address order."""
        return [(a, self._ranges[a][0] - a) for a in self._starts]

    def _overlap(self, address: int, length: int) -> tuple[int, int, str] | None:
        """A registered range overlapping ``[address, address + length)``, or None."""
        i = bisect.bisect_right(self._starts, address + length - 1) - 1
        if i >= 0:
            a = self._starts[i]
            end, what = self._ranges[a]
            if end > address:
                return a, end, what
        return None

    def register(self, memory) -> list[tuple[int, int]]:
        """Registers ``memory`` (a pool, host pool, chunk staging, bounce buffer, or an
        ``(address, bytes)`` pair) with Mooncake and returns its regions. Memory overlapping a
        registration already made raises ``AlreadyRegisteredError`` (use ``ensure`` to reuse
        one); every region is checked before any is registered."""
        regions = regions_of(memory)
        what = _what(memory)
        for address, length in regions:
            hit = self._overlap(address, length)
            if hit is not None:
                raise AlreadyRegisteredError(
                    f"{what} at {address:#x}+{length} overlaps the registered {hit[2]} at "
                    f"{hit[0]:#x}+{hit[1] - hit[0]}: register each piece of memory once"
                )
        done: list[tuple[int, int]] = []
        for address, length in regions:
            rc = self.te.register_memory(address, length)
            if rc != 0:
                for a, _ in done:
                    self.te.unregister_memory(a)
                    self._forget(a)
                raise TransferError(f"Mooncake register_memory({address:#x}, {length}) of {what} returned {rc}")
            bisect.insort(self._starts, address)
            self._ranges[address] = (address + length, what)
            done.append((address, length))
        return regions

    def ensure(self, memory) -> bool:
        """Registers ``memory`` unless each of its regions is registered exactly as it is
        (then reuses them); returns whether it registered now. Partly registered memory raises
        ``AlreadyRegisteredError``."""
        regions = regions_of(memory)
        if all(self._ranges.get(a, (None,))[0] == a + n for a, n in regions):
            return False
        self.register(memory)
        return True

    def unregister(self, memory) -> None:
        """Unregisters ``memory``; raises ``NotRegisteredError`` (and unregisters nothing)
        unless each of its regions is registered exactly as it is."""
        regions = regions_of(memory)
        for a, n in regions:
            if self._ranges.get(a, (None,))[0] != a + n:
                raise NotRegisteredError(f"{_what(memory)} at {a:#x}+{n} is not registered with this engine")
        for a, _ in regions:
            self.te.unregister_memory(a)
            self._forget(a)

    def _forget(self, address: int) -> None:
        self._starts.remove(address)
        del self._ranges[address]

    def covers(self, address: int, length: int) -> bool:
        """Whether one registration holds all of ``[address, address + length)``."""
        hit = self._overlap(address, max(length, 1))
        return hit is not None and hit[0] <= address and address + length <= hit[1]

    def write_sync(self, target: str, src_addrs, dst_addrs, lengths) -> None:
        """Writes each ``lengths[i]`` bytes at local ``src_addrs[i]`` to ``dst_addrs[i]`` of
        the engine ``target`` (its ``Engine.address``), ``max_batch`` descriptors per Mooncake
        batch, and returns once all landed. Every local range must lie in a registration
        (``NotRegisteredError`` otherwise, before anything moves); a failed batch raises
        ``TransferError`` (the destination is the peer's to check: Mooncake refuses
        unregistered remote memory)."""
        src, dst, lens = list(src_addrs), list(dst_addrs), list(lengths)
        if not len(src) == len(dst) == len(lens):
            raise InvalidArgumentError(f"{len(src)} sources, {len(dst)} destinations, {len(lens)} lengths")
        for s, n in zip(src, lens):
            if not self.covers(s, n):
                raise NotRegisteredError(f"the local range {s:#x}+{n} lies in no registration of this engine")
        for i in range(0, len(lens), self.max_batch):
            j = i + self.max_batch
            rc = self.te.batch_transfer_sync_write(target, src[i:j], dst[i:j], lens[i:j])
            if rc != 0:
                raise TransferError(f"Mooncake batch_transfer_sync_write to {target} returned {rc}")

    def close(self) -> None:
        """Unregisters every registration."""
        for address in list(self._starts):
            self.te.unregister_memory(address)
            self._forget(address)
