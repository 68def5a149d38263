"""P/D over Mooncake's transfer engine (``mooncake.engine.TransferEngine``, the PyPI wheels
``mooncake-transfer-engine``, ``-cuda13`` and ``-non-cuda``): kvshard plans every chunk
(``MooncakeSender``) and Mooncake moves it, as coalesced (source, destination, length) lists or
as one packed range per chunk and rank (bounce mode).

::

    decode: MooncakeDecode                               prefill rank r: MooncakePrefill
      pool, K BounceBuffers per rank (slots)               pool, its K bounce buffers
      registered once (Engine.ensure)                      registered once (Engine.ensure)
      hello (engine address, layer bases, slots) ──side channel──> MooncakeSender(...)
      register(registration) ── register ─────────────────────────> open
                                                                    send: plan -> lists (or pack
                                                                    into a free slot)
                                     <── Mooncake batch write ───── batch_transfer_async_write
      poll(): scatter bounced chunks, Receiver  <── status ───────── once the batch has completed
      free slot s (its scatter has run) ───────────────────────────> slot s may take a chunk

**Registration.** ``Engine`` registers each piece of kvshard memory with Mooncake once and
reuses it: device pools (and a pool wrapping an engine's exportable VMM tensors, which is one),
HiCache's host pools, chunk staging, bounce buffers, or raw ``(address, bytes)``
(``kvshard.engine_regions`` gives each one's contiguous regions). A second registration of
memory that overlaps registered memory raises ``AlreadyRegisteredError``; ``ensure`` reuses a
registration; a local range outside every registration raises ``NotRegisteredError`` before
the engine is called (``Engine.write_sync``), and so does unregistering what is not registered.

**Bounce slots.** Each prefill rank has K bounce slots (``MooncakeDecode(bounce_slots=K)``
sizes both sides): chunk k + 1 packs into a free slot while chunk k is on the wire from another.
A slot is reused only once its chunk's transfer was reported (the engine no longer reads this
side's buffer; ``MooncakeSender.bounce_free`` refuses otherwise) and the decode's scatter from
its side has run (the decode frees it only after the scatter's event).

**Completion.** Mooncake's engine (0.3.x) sends no notification with a transfer, so the chunk
statuses travel on a side channel: one TCP connection per prefill rank to the decode side,
carrying length-prefixed JSON frames. kvshard's own control channel (``kvshard::ipc``) has no
Python API, and the side channel needs nothing more than ordered, reliable delivery and a
peer's death seen as the connection's end: a killed process's socket is closed by its kernel,
so the other side learns of it at once, without waiting for a timeout. A prefill rank reports a
chunk only after ``get_batch_transfer_status`` (run on a worker thread: it blocks) says its
batch completed, so a status never overtakes its bytes; the decode side orders statuses per
(request, rank) by chunk before its ``Receiver`` sees them.

**Deadlines.** A chunk the engine has not reported by ``transfer_timeout`` fails on the prefill
side (``ChunkFailedError``); the decode side's ``Receiver`` reports each request whose deadline
passed (``Overdue``); a peer whose connection ends fails every open request with it at once.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import json
import select
import socket
import struct
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from . import _kvshard as _k
from ._errors import ChunkFailedError, InvalidArgumentError, TransferError, UnavailableError

__all__ = [
    "AlreadyRegisteredError",
    "Engine",
    "NotRegisteredError",
    "MooncakeDecode",
    "MooncakePrefill",
    "load_engine_class",
]

#: How long connecting, the hello exchange and one frame's send may take.
CONNECT_TIMEOUT = 30.0


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
    ``ChunkStaging`` or ``BounceBuffer`` (``kvshard.engine_regions``), or an ``(address,
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


class _Channel:
    """One side-channel connection: length-prefixed JSON frames; reads never block, a send
    blocks at most ``CONNECT_TIMEOUT``; ``closed`` says why the peer is gone."""

    def __init__(self, sock: socket.socket):
        sock.settimeout(CONNECT_TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.buf = b""
        self.closed: str | None = None

    def send(self, msg: dict) -> None:
        if self.closed:
            raise TransferError(f"the side channel is closed: {self.closed}")
        data = json.dumps(msg).encode()
        try:
            self.sock.sendall(struct.pack("<I", len(data)) + data)
        except OSError as e:
            self.closed = f"send failed: {e}"
            raise TransferError(f"the side channel is closed: {self.closed}") from e

    def receive(self) -> list[dict]:
        """Every whole frame that has arrived (never blocks)."""
        while not self.closed:
            try:
                ready, _, _ = select.select([self.sock], [], [], 0)
                if not ready:
                    break
                chunk = self.sock.recv(1 << 20)
            except OSError as e:
                self.closed = f"receive failed: {e}"
                break
            if not chunk:
                self.closed = "the peer closed the connection (its process ended)"
                break
            self.buf += chunk
        out = []
        while len(self.buf) >= 4:
            (n,) = struct.unpack_from("<I", self.buf)
            if len(self.buf) < 4 + n:
                break
            out.append(json.loads(self.buf[4 : 4 + n]))
            self.buf = self.buf[4 + n :]
        return out

    def receive_one_sync(self, timeout: float) -> dict:
        """The next frame, waiting at most ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while True:
            got = self.receive()
            if got:
                if len(got) > 1:
                    # Keep the rest for the next receive, in order.
                    rest = b"".join(
                        struct.pack("<I", len(d)) + d for d in (json.dumps(m).encode() for m in got[1:])
                    )
                    self.buf = rest + self.buf
                return got[0]
            if self.closed:
                raise TransferError(f"the side channel closed: {self.closed}")
            left = end - time.monotonic()
            if left <= 0:
                raise TransferError(f"no message on the side channel within {timeout} s")
            select.select([self.sock], [], [], min(left, 0.05))

    def close(self) -> None:
        self.closed = self.closed or "closed here"
        self.sock.close()


#: Components by their ``int`` (the wire's code).
_COMPONENTS = {
    int(c): c
    for c in (
        _k.Component.TARGET_LATENT,
        _k.Component.TARGET_INDEXER,
        _k.Component.DRAFT_LATENT,
        _k.Component.DRAFT_INDEXER,
    )
}


def _shape(geometry) -> list:
    """A geometry as both sides compare it: (component, layers, block bytes) per component."""
    return [[int(c.component), c.layers, c.block_bytes] for c in geometry.components()]


class MooncakeDecode:
    """The decode side: registers its pool and ``bounce_slots`` bounce buffers per prefill
    rank with its engine (once: memory ``engine`` already holds is reused), serves the side
    channel (``address``), registers requests with every rank, and turns the ranks' statuses
    into finished requests (``poll``)."""

    def __init__(
        self,
        pool,
        ranks: int,
        *,
        engine: Engine | None = None,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        bounce_pages: int = 64,
        bounce_slots: int = 2,
        deadline: float | None = None,
        stream=None,
    ):
        self.pool = pool
        self.ranks = ranks
        self._own_engine = engine is None
        self.engine = engine or Engine(listen[0])
        _, self.bases = _k.engine_memory(pool)
        #: rank -> its bounce buffers, one per slot.
        self.bounces = [
            [_k.BounceBuffer(pool.device, pool.geometry, bounce_pages, stream) for _ in range(bounce_slots)]
            for _ in range(ranks)
        ] if bounce_pages > 0 else [[] for _ in range(ranks)]
        # What this side registered (and unregisters at close); memory the engine held is reused.
        self._mine = [m for m in [pool, *(b for bs in self.bounces for b in bs)] if self.engine.ensure(m)]
        self.receiver = _k.Receiver(deadline)
        self._server = socket.create_server(listen)
        #: Where prefill ranks connect.
        self.address = self._server.getsockname()[:2]
        self.channels: dict[int, _Channel] = {}
        self.gone: dict[int, str] = {}
        # (request, rank) -> next chunk expected; held statuses by chunk; scatters in flight.
        self._next: dict[tuple[int, int], int] = {}
        self._held: dict[tuple[int, int], dict[int, dict]] = {}
        self._queue: dict[int, deque] = {r: deque() for r in range(ranks)}
        # request -> ranks that still owe their last status
        self._owing: dict[int, set[int]] = {}

    def accept_sync(self, timeout: float = CONNECT_TIMEOUT) -> None:
        """Waits (at most ``timeout`` seconds) for every prefill rank to connect, and greets
        each with what it needs: this engine's address, the pool's layer bases and pages, its
        bounce buffer, the geometry."""
        self._server.settimeout(timeout)
        end = time.monotonic() + timeout
        while len(self.channels) < self.ranks:
            self._server.settimeout(max(end - time.monotonic(), 0.001))
            try:
                sock, _ = self._server.accept()
            except socket.timeout as e:
                raise TransferError(
                    f"{len(self.channels)} of {self.ranks} prefill ranks connected within {timeout} s"
                ) from e
            ch = _Channel(sock)
            hi = ch.receive_one_sync(max(end - time.monotonic(), 0.001))
            rank = int(hi["rank"])
            if hi.get("shape") != _shape(self.pool.geometry) or not 0 <= rank < self.ranks or rank in self.channels:
                ch.send({"t": "refused", "why": "another geometry, or a rank out of range or taken"})
                ch.close()
                continue
            ch.send(
                {
                    "t": "hello",
                    "engine": self.engine.address,
                    "bases": self.bases,
                    "pages": self.pool.pages,
                    "bounce": [[b.address, b.bytes] for b in self.bounces[rank]],
                }
            )
            self.channels[rank] = ch

    def register(self, registration, *, deadline: float | None = None) -> None:
        """Expects ``registration`` from every rank (due ``deadline`` seconds from now) and
        sends it to them; a rank already gone fails it at once."""
        request = registration.request
        self.receiver.register(registration, self.ranks, deadline=deadline)
        self._owing[request] = set(range(self.ranks))
        msg = {
            "t": "register",
            "request": request,
            "pages": registration.pages,
            "state_pages": registration.state_pages,
            "prefix_pages": registration.prefix_pages,
        }
        for rank in range(self.ranks):
            self._next[(request, rank)] = 0
            try:
                self.channels[rank].send(msg)
            except (TransferError, KeyError):
                pass  # reported below, as a gone rank
        self._fail_gone()

    def poll(self) -> tuple[list, list]:
        """Takes every status that arrived, scatters bounced chunks, and returns
        ``(finished, overdue)``: the ``Finished`` requests (pages handed back, completed or
        failed) and the ``Overdue`` ones (their deadline passed). Never blocks."""
        finished = []
        for rank, ch in self.channels.items():
            for m in ch.receive():
                if m.get("t") == "status":
                    key = (m["request"], rank)
                    self._held.setdefault(key, {})[m["chunk"]] = m
                    self._release(key)
            if ch.closed and rank not in self.gone:
                self.gone[rank] = ch.closed
        for rank in range(self.ranks):
            finished += self._drain(rank)
        finished += self._fail_gone()
        return finished, self.receiver.expire()

    def _release(self, key) -> None:
        """Queues a (request, rank)'s held statuses in chunk order, from the one expected."""
        held = self._held.get(key, {})
        while key in self._next and self._next[key] in held:
            m = held.pop(self._next[key])
            self._next[key] += 1
            event = None
            if m.get("sections") and m["ok"]:
                try:
                    bounce = self.bounces[key[1]][m["slot"]]
                    event = bounce.scatter([tuple(s) for s in m["sections"]], self.pool)
                except Exception as e:  # noqa: BLE001 - a bad report fails the chunk, typed below
                    m = {**m, "ok": False, "reason": f"scattering bounce slot {m.get('slot')} failed: {e}"}
            self._queue[key[1]].append((m, event))
            if not m["ok"] or m["last"]:
                del self._next[key]
        if not held:
            self._held.pop(key, None)

    def _drain(self, rank) -> list:
        """Delivers rank's queued statuses whose scatter has run, in order."""
        out = []
        q = self._queue[rank]
        while q:
            m, event = q[0]
            if event is not None and not event.query():
                break
            q.popleft()
            if m.get("slot") is not None and rank in self.channels:
                # Its scatter has run (or none was started): the rank may pack into the slot.
                try:
                    self.channels[rank].send({"t": "free", "slot": m["slot"]})
                except TransferError:
                    pass  # the rank is gone: nothing to free
            out += self._deliver(rank, m)
        return out

    def _deliver(self, rank, m) -> list:
        request = m["request"]
        if m["ok"]:
            status = _k.ChunkStatus.sent(
                request, rank, m["chunk"], m["last"], {_COMPONENTS[int(c)]: n for c, n in m["bytes"].items()}
            )
        else:
            status = _k.ChunkStatus.failed(request, rank, m["chunk"], m["reason"])
        if status.terminal:
            self._owing.get(request, set()).discard(rank)
        done = self.receiver.receive(status)
        if done is not None:
            self._owing.pop(request, None)
            return [done]
        return []

    def _fail_gone(self) -> list:
        """Fails every open request at the chunk each gone rank owes (once its queued
        statuses, which arrived before it went, are delivered)."""
        out = []
        for rank, why in self.gone.items():
            if self._queue[rank]:
                continue
            for request, owing in list(self._owing.items()):
                if rank not in owing:
                    continue
                chunk = self._next.pop((request, rank), 0)
                self._held.pop((request, rank), None)
                out += self._deliver(
                    rank, {"request": request, "chunk": chunk, "ok": False, "reason": f"prefill rank {rank} is gone: {why}"}
                )
        return out

    def close(self) -> None:
        """Closes the side channel and unregisters the memory it registered (all of the
        engine's, when it made the engine)."""
        for ch in self.channels.values():
            ch.close()
        self._server.close()
        _release_memory(self.engine, self._own_engine, self._mine)


def _release_memory(engine: Engine, own: bool, mine: list) -> None:
    if own:
        engine.close()
    else:
        for m in mine:
            engine.unregister(m)


class _Flight:
    """A chunk between ``send`` and its status."""

    __slots__ = ("chunk", "future", "started", "posted", "freed")

    def __init__(self, chunk: _k.MooncakeChunk) -> None:
        self.chunk = chunk
        self.future: Future | None = None
        self.started = time.perf_counter()
        self.posted = False
        #: Its bounce slot was freed here (a failed chunk: no scatter frees it).
        self.freed = False


class MooncakePrefill:
    """One prefill rank: connects to the decode side's side channel (``decode``, its
    ``MooncakeDecode.address``), registers its pool and bounce buffers (one per slot the decode
    side offers) with its engine (once: memory ``engine`` already holds is reused), and
    moves each chunk ``send`` plans with Mooncake batch writes (``max_batch`` descriptors each,
    in turn: its TCP transport refuses a batch of many thousands). Constructing it waits (at
    most ``CONNECT_TIMEOUT``) for the decode side's hello. Call ``progress`` every
    scheduling step: it posts packed chunks, reports landed or failed ones to the decode side,
    and returns their statuses."""

    def __init__(
        self,
        pool,
        decode: tuple[str, int],
        *,
        engine: Engine | None = None,
        mode=None,
        bounce_pages: int = 64,
        bounce_below: int = 512 << 10,
        transfer_timeout: float = 30.0,
        workers: int = 4,
        max_batch: int = 512,
        stream=None,
    ):
        self.pool = pool
        #: Descriptors per Mooncake batch (a chunk of more is posted in several, in turn).
        self.max_batch = max_batch
        self._own_engine = engine is None
        self.engine = engine or Engine(decode[0])
        self.channel = _Channel(socket.create_connection(decode, timeout=CONNECT_TIMEOUT))
        self.channel.send({"t": "hi", "rank": pool.rank, "shape": _shape(pool.geometry)})
        hello = self.channel.receive_one_sync(CONNECT_TIMEOUT)
        if hello.get("t") != "hello":
            raise TransferError(f"the decode side refused rank {pool.rank}: {hello.get('why')}")
        self.target = hello["engine"]
        self.decode_pages = hello["pages"]
        self.sender = _k.MooncakeSender(
            pool,
            hello["bases"],
            hello["pages"],
            mode=mode if mode is not None else _k.MooncakeMode.AUTO,
            bounce_pages=bounce_pages,
            decode_bounces=[tuple(b) for b in hello["bounce"]],
            bounce_below=bounce_below,
            transfer_timeout=transfer_timeout,
            stream=stream,
        )
        self._mine = [m for m in [pool, *self.sender.bounce_regions] if self.engine.ensure(m)]
        self._flights: deque[_Flight] = deque()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvshard-mooncake")
        #: Registrations the decode side sent, by request, opened on the sender.
        self.registrations: dict[int, object] = {}
        self._layout = _k.PoolLayout.packed(pool.geometry, self.decode_pages)
        #: Seconds spent in the engine's post calls alone (``stats()["post_seconds"]`` adds
        #: kvshard's planning and the packing launch, which on the CPU twin runs the copy).
        self.engine_post_seconds = 0.0

    @property
    def gone(self) -> str | None:
        """Why the decode side is gone, or None."""
        return self.channel.closed

    def _read(self) -> None:
        for m in self.channel.receive():
            if m["t"] == "register":
                reg = _k.Registration(
                    m["request"], self._layout, m["pages"], m["state_pages"], m["prefix_pages"]
                )
                self.sender.open(reg)
                self.registrations[m["request"]] = reg
            elif m["t"] == "free":
                self.sender.bounce_free(m["slot"])

    def take_registrations(self) -> list:
        """The requests the decode side registered since the last call (opened here)."""
        self._read()
        out = list(self.registrations.values())
        self.registrations.clear()
        return out

    def send(self, request: int, pages, end: int, *, last: bool):
        """Plans the next chunk of ``request`` and posts it (a bounced one once its packing
        has run, at a later ``progress``); returns its ``MooncakeChunk``. A chunk that cannot
        be planned raises ``ChunkFailedError``, whose status is delivered here."""
        if self.gone:
            self.sender.abort(request, f"the decode side is gone: {self.gone}")
            raise TransferError(f"request {request}: the decode side is gone: {self.gone}")
        try:
            chunk = self.sender.send(request, list(pages), end, last=last)
        except ChunkFailedError as e:
            self._report(e.status, None)
            raise
        flight = _Flight(chunk)
        self._flights.append(flight)
        self._advance(flight)
        return chunk

    def _submit(self, src, dst, lengths):
        """One Mooncake batch write; its id, or the failure as a string."""
        batch = self.engine.te.batch_transfer_async_write(self.target, src, dst, lengths)
        if batch == 0 or batch < 0 or batch >= 1 << 63:
            return f"Mooncake batch_transfer_async_write returned {batch}"
        return batch

    def _rest(self, first, src, dst, lengths):
        """Runs on a worker thread: waits for the first batch, then posts and waits for the
        rest of a chunk's descriptors, ``max_batch`` at a time; 0 once all completed."""
        batch = first
        at = 0
        while True:
            rc = self.engine.te.get_batch_transfer_status([batch])
            at += self.max_batch
            if rc != 0 or at >= len(lengths):
                return rc
            end = at + self.max_batch
            batch = self._submit(src[at:end], dst[at:end], lengths[at:end])
            if isinstance(batch, str):
                return batch

    def _post(self, flight: _Flight) -> None:
        c = flight.chunk
        src, dst, lengths = c.src_addrs, c.dst_addrs, c.lengths
        t0 = time.perf_counter()
        # Mooncake's TCP transport refuses batches that overflow its queues (thousands of
        # descriptors): a long list goes ``max_batch`` at a time, the rest from the worker.
        first = self._submit(src[: self.max_batch], dst[: self.max_batch], lengths[: self.max_batch])
        post = time.perf_counter() - t0
        self.engine_post_seconds += post
        c.posted(post)
        flight.posted = True
        if isinstance(first, str):
            c.failed(first)
            return
        flight.future = self._pool.submit(self._rest, first, src, dst, lengths)

    def _advance(self, flight: _Flight) -> None:
        c = flight.chunk
        if not flight.posted:
            if c.descriptors == 0:
                c.posted(0.0)
                flight.posted = True
                c.landed(time.perf_counter() - flight.started)
            elif c.ready():
                self._post(flight)
        if flight.future is not None and flight.future.done():
            fut, flight.future = flight.future, None
            try:
                rc = fut.result()
            except Exception as e:  # noqa: BLE001 - the engine's own failure, reported typed
                rc = f"raised {e}"
            try:
                if rc == 0:
                    c.landed(time.perf_counter() - flight.started)
                else:
                    c.failed(f"Mooncake get_batch_transfer_status returned {rc}")
            except Exception:  # noqa: BLE001 - already failed by its deadline: nothing to add
                pass

    def _report(self, status, chunk) -> None:
        msg = {
            "t": "status",
            "request": status.request,
            "chunk": status.chunk,
            "ok": status.ok,
            "last": status.last,
            "bytes": {int(c): n for c, n in status.bytes.items()},
            "reason": status.reason,
            "sections": chunk.sections if chunk is not None and status.ok else [],
            # The decode frees the slot once it has scattered it (a failed chunk's is freed here).
            "slot": chunk.slot if chunk is not None and status.ok else None,
        }
        try:
            self.channel.send(msg)
        except TransferError:
            pass  # the decode side is gone: its own side fails the request

    def progress(self) -> list:
        """Moves every chunk forward and returns the statuses of those that finished (landed
        or failed, each delivered to the decode side), in send order. Never blocks."""
        self._read()
        out = []
        for flight in list(self._flights):
            c = flight.chunk
            if self.gone and flight.future is None:
                try:
                    c.failed(f"the decode side is gone: {self.gone}")
                except Exception:  # noqa: BLE001 - already reported
                    pass
            self._advance(flight)
            try:
                status = c.poll()
            except ChunkFailedError as e:
                status = e.status
                # Closed here unless a later chunk already ended it (its final one was sent).
                with contextlib.suppress(TransferError):
                    self.sender.close(c.request)
            if status is None:
                continue
            if c.bounced and not status.ok:
                if flight.future is not None and not flight.future.done():
                    # Failed by its deadline while the engine still reads the slot: free it
                    # once the engine is done (the chunk reported failed first, as
                    # bounce_free requires).
                    flight.future.add_done_callback(functools.partial(self._free_failed_when_done, flight))
                else:
                    # Never posted, or the engine is done with it: no scatter will free it.
                    self._free_failed(flight)
            self._flights.remove(flight)
            self._report(status, c)
            out.append(status)
        return out

    def _free_failed(self, flight: _Flight) -> None:
        """Frees a failed chunk's bounce slot once (the engine no longer reads it)."""
        slot = flight.chunk.slot
        if flight.freed or slot is None:
            return
        flight.freed = True
        with contextlib.suppress(InvalidArgumentError):  # already reported: that one stands
            flight.chunk.failed("the chunk failed before the engine finished with it")
        self.sender.bounce_free(slot)

    def _free_failed_when_done(self, flight: _Flight, _done: Future) -> None:
        self._free_failed(flight)

    @property
    def in_flight(self) -> int:
        """Chunks sent whose status has not been taken."""
        return len(self._flights)

    def stats(self) -> dict:
        """The sender's transfer counters (``MooncakeSender.stats``)."""
        return self.sender.stats()

    def close(self) -> None:
        """Closes the side channel and deregisters the memory, after the engine is done with
        every posted batch (waits for the worker threads: at most Mooncake's own transfer
        timeout)."""
        self._pool.shutdown(wait=True)
        self.channel.close()
        _release_memory(self.engine, self._own_engine, self._mine)
