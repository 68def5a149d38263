"""P/D over Mooncake's transfer engine (``mooncake.engine.TransferEngine``, the PyPI wheels
``mooncake-transfer-engine``, ``-cuda13`` and ``-non-cuda``): kvshard plans every chunk
(``MooncakeSender``) and Mooncake moves it, as coalesced (source, destination, length) lists or
as one packed range per chunk and rank (bounce mode).

::

    decode: MooncakeDecode (its MooncakeReceiver)        prefill rank r: MooncakePrefill
      pool, K bounce buffers per rank (slots)              pool, its K bounce buffers
      registered once (Engine.ensure)                      registered once (Engine.ensure)
      hello (engine address, layer bases, slots) ──side channel──> MooncakeSender(...)
      register(registration) ── register ─────────────────────────> open
                                                                    send: plan -> lists (or pack
                                                                    into a free slot)
                                     <── Mooncake batch write ───── batch_transfer_async_write
      poll(): check, scatter, order, Receiver <── status ────────── once the batch has completed
      free (slot, request, chunk), its scatter run ────────────────> the slot may take a chunk
      overdue: abort ──────────────────────────────────────────────> aborted, once nothing of
                                                                    the request is in flight

The transport is library code (``kvshard::transfer::mooncake``, docs/mooncake.md): the
sender, the side channel's frames and the decode side that checks them are Rust; this module
moves the engine's batches and the side channel's bytes.

**Registration.** ``Engine`` registers each piece of kvshard memory with Mooncake once and
reuses it: device pools (and a pool wrapping an engine's exportable VMM tensors, which is one),
HiCache's host pools, chunk staging, bounce buffers, or raw ``(address, bytes)``
(``kvshard.transfer.engine_regions`` gives each one's contiguous regions). A second registration of
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
carrying kvshard's binary frames (``kvshard::transfer::mooncake::frames``: a checked header,
then one postcard-encoded frame). kvshard's control channel (``kvshard::ipc``) is a Unix
socket between processes of one host; the side channel needs ordered, reliable delivery
across hosts and a peer's death seen as the connection's end: a killed process's socket is
closed by its kernel, so the other side learns of it at once. A prefill rank reports a chunk
only after ``get_batch_transfer_status`` (run on a worker thread: it blocks) says its batch
completed, so a status never overtakes its bytes; the decode side orders statuses per
(request, rank) by chunk before its ``Receiver`` sees them.

**Bad peers.** Nothing a peer sends is trusted. A malformed, truncated, oversize or unknown
frame is refused and counted, and its connection closed: on the decode side that rank is gone
(its requests fail once what it reported before was taken), on a prefill the decode side is.
A status is checked before use (its rank, a bounce slot of the rank's that is free, sections
that fit the buffer and the pool); one of a request not being received from the rank, or a
duplicate, is dropped and counted, never buffered (the slot it names is freed for exactly
that chunk: a prefill frees a slot only for the chunk it holds); statuses waiting for an
earlier chunk are bounded. ``accept_sync`` serves connections concurrently, each with its own
hello deadline: a client that says nothing keeps no rank waiting.

**Deadlines.** A chunk the engine has not reported by ``transfer_timeout`` fails on the prefill
side (``ChunkFailedError``); the decode side reports each request whose deadline passed
(``Overdue``) and asks the ranks that owe it to abort it: each answers once nothing of it is in
flight, and the request is handed back failed. A peer whose connection ends fails every open
request with it at once.
"""

from __future__ import annotations

import contextlib
import functools
import select
import socket
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from . import _kvshard as _k
from ._errors import ChunkFailedError, InvalidArgumentError, TransferError

# The side channel's Rust half: its frames and the decode side that checks them.
from ._kvshard import MooncakeReceiver, SideReader, side_frame, side_shape  # noqa: E402
from . import _home  # noqa: E402

_home.settle(__name__, ["MooncakeReceiver", "SideReader"], globals())
from ._mooncake_engine import (  # noqa: E402
    AlreadyRegisteredError,
    Engine,
    NotRegisteredError,
    load_engine_class,
)

__all__ = [
    "AlreadyRegisteredError",
    "Engine",
    "NotRegisteredError",
    "MooncakeDecode",
    "MooncakePrefill",
    "MooncakeReceiver",
    "SideReader",
    "load_engine_class",
    "side_frame",
    "side_shape",
]

#: How long connecting, the hello exchange and one frame's send may take.
CONNECT_TIMEOUT = 30.0
#: How long a connection to the decode side may take to say its hello.
HELLO_TIMEOUT = 10.0
#: Most connections that may wait to say their hello at once.
MAX_PENDING = 64
#: Most bytes one read of a connection takes (the rest waits for the next poll).
READ_LIMIT = 4 << 20


class _Channel:
    """One side-channel connection: sends block at most ``CONNECT_TIMEOUT``; ``read`` never
    blocks; ``closed`` says why the peer is gone. The bytes are framed and checked in Rust
    (``SideReader``, ``MooncakeReceiver.feed``)."""

    def __init__(self, sock: socket.socket):
        sock.settimeout(CONNECT_TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.closed: str | None = None

    def send(self, data: bytes) -> None:
        if self.closed:
            raise TransferError(f"the side channel is closed: {self.closed}")
        if not data:
            return
        try:
            self.sock.sendall(data)
        except OSError as e:
            self.close(f"send failed: {e}")
            raise TransferError(f"the side channel is closed: {self.closed}") from e

    def read(self) -> bytes:
        """What has arrived, at most ``READ_LIMIT`` bytes (never blocks); the end of the
        stream closes the channel."""
        out = []
        got = 0
        while not self.closed and got < READ_LIMIT:
            try:
                ready, _, _ = select.select([self.sock], [], [], 0)
                if not ready:
                    break
                chunk = self.sock.recv(min(1 << 20, READ_LIMIT - got))
            except (OSError, ValueError) as e:
                self.close(f"receive failed: {e}")
                break
            if not chunk:
                self.close("the peer closed the connection (its process ended)")
                break
            out.append(chunk)
            got += len(chunk)
        return b"".join(out)

    def wait_readable(self, timeout: float) -> None:
        """Waits at most ``timeout`` seconds for bytes (or the end) to arrive."""
        if not self.closed:
            with contextlib.suppress(OSError, ValueError):
                select.select([self.sock], [], [], max(timeout, 0.0))

    def close(self, why: str = "closed here") -> None:
        self.closed = self.closed or why
        with contextlib.suppress(OSError):
            self.sock.close()


def _first_frame_sync(ch: _Channel, reader, timeout: float) -> dict:
    """The first frame of a connection, waiting at most ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        frames = reader.feed(ch.read())
        if reader.error:
            ch.close(f"protocol violation: {reader.error}")
            raise TransferError(f"the side channel broke the protocol: {reader.error}")
        if frames:
            return frames[0]
        if ch.closed:
            raise TransferError(f"the side channel closed: {ch.closed}")
        left = end - time.monotonic()
        if left <= 0:
            raise TransferError(f"no message on the side channel within {timeout} s")
        ch.wait_readable(min(left, 0.05))


class MooncakeDecode:
    """The decode side: its ``receiver`` (``kvshard.mooncake.MooncakeReceiver``) holds the pool and
    ``bounce_slots`` bounce buffers per prefill rank, registered with its engine (once: memory
    ``engine`` already holds is reused); it serves the side channel (``address``), registers
    requests with every rank, and turns the ranks' statuses into finished requests (``poll``).
    Everything a rank sends is checked before use (module docs: Bad peers)."""

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
        self.receiver = _k.MooncakeReceiver(
            pool, ranks, bounce_pages=bounce_pages, bounce_slots=bounce_slots, deadline=deadline, stream=stream
        )
        self._own_engine = engine is None
        self.engine = engine or Engine(listen[0])
        #: rank -> its bounce buffers, ``(address, bytes)`` one per slot.
        self.bounces = [self.receiver.bounce_regions(r) for r in range(ranks)]
        # What this side registered (and unregisters at close); memory the engine held is reused.
        self._mine = [m for m in [pool, *(b for bs in self.bounces for b in bs)] if self.engine.ensure(m)]
        self._server = socket.create_server(listen)
        self._server.setblocking(False)
        #: Where prefill ranks connect.
        self.address = self._server.getsockname()[:2]
        self.channels: dict[int, _Channel] = {}
        #: rank -> why it is gone (its connection ended, or it broke the protocol).
        self.gone: dict[int, str] = {}
        #: Connections closed before they said a valid hello (silent, refused, malformed).
        self.refused_connections = 0

    def accept_sync(self, timeout: float = CONNECT_TIMEOUT, hello_timeout: float = HELLO_TIMEOUT) -> None:
        """Waits (at most ``timeout`` seconds) for every prefill rank to connect and say hello,
        serving connections concurrently: each has ``hello_timeout`` seconds for its ``hi``
        (a client that says nothing is closed then, and keeps no one else waiting), at most
        ``MAX_PENDING`` wait at once. Each rank is greeted with what it needs: this engine's
        address, the pool's layer bases and pages, its bounce buffers."""
        end = time.monotonic() + timeout
        pending: dict[socket.socket, tuple[_Channel, object, float]] = {}
        try:
            while len(self.channels) < self.ranks:
                now = time.monotonic()
                if now >= end:
                    raise TransferError(
                        f"{len(self.channels)} of {self.ranks} prefill ranks connected within {timeout} s"
                    )
                for sock, (ch, _, due) in list(pending.items()):
                    if now >= due:
                        self._refuse(pending, sock, ch)
                wake = min([end, *(due for _, _, due in pending.values())])
                # At most a second per look (select refuses a timeout past its range).
                ready, _, _ = select.select([self._server, *pending], [], [], min(max(wake - now, 0.0), 1.0))
                for sock in ready:
                    if sock is self._server:
                        self._accept_one(pending, min(end, time.monotonic() + hello_timeout))
                    else:
                        self._greet(pending, sock)
        finally:
            for sock, (ch, _, _) in list(pending.items()):
                self._refuse(pending, sock, ch)

    def _accept_one(self, pending: dict, due: float) -> None:
        try:
            sock, _ = self._server.accept()
        except (BlockingIOError, InterruptedError):
            return
        ch = _Channel(sock)
        if len(pending) >= MAX_PENDING:
            self.refused_connections += 1
            ch.close("too many connections waiting to say hello")
            return
        pending[sock] = (ch, _k.SideReader(), due)

    def _refuse(self, pending: dict, sock, ch: _Channel) -> None:
        del pending[sock]
        self.refused_connections += 1
        ch.close("refused")

    def _greet(self, pending: dict, sock) -> None:
        ch, reader, _ = pending[sock]
        frames = reader.feed(ch.read())
        if not frames:
            if reader.error or ch.closed:
                self._refuse(pending, sock, ch)
            return
        rank, reply = self.receiver.join(frames[0], self.engine.address)
        if len(frames) > 1 or reader.buffered:
            # A rank speaks only once it has been greeted.
            rank, reply = None, _k.side_frame({"t": "refused", "why": "frames after hi, before hello"})
        with contextlib.suppress(TransferError):
            ch.send(reply)
        if rank is None or ch.closed:
            self._refuse(pending, sock, ch)
            return
        del pending[sock]
        self.channels[rank] = ch

    def register(self, registration, *, deadline: float | None = None) -> None:
        """Expects ``registration`` from every rank (due ``deadline`` seconds from now) and
        sends it to them; a rank already gone fails it at once."""
        data = self.receiver.register(registration, deadline=deadline)
        for rank, ch in self.channels.items():
            if rank not in self.gone:
                with contextlib.suppress(TransferError):
                    ch.send(data)
        self._notice_gone()

    def poll(self) -> tuple[list, list]:
        """Takes every status that arrived (each checked; a rank that broke the protocol is
        closed and gone), and returns ``(finished, overdue)``: the ``Finished`` requests (pages
        handed back, completed or failed) and the ``Overdue`` ones (their deadline passed; the
        ranks that owe them are told to abort them, and they are handed back once those have
        answered or are gone). Never blocks."""
        for rank, ch in self.channels.items():
            if rank in self.gone:
                continue
            data = ch.read()
            if data:
                error = self.receiver.feed(rank, data)
                if error is not None:
                    ch.close(f"protocol violation: {error}")
        self._notice_gone()
        finished = self.receiver.poll()
        overdue = self.receiver.expire()
        for rank, ch in self.channels.items():
            if rank not in self.gone:
                with contextlib.suppress(TransferError):
                    ch.send(self.receiver.take_outgoing(rank))
        self._notice_gone()
        return finished, overdue

    def _notice_gone(self) -> None:
        for rank, ch in self.channels.items():
            if ch.closed and rank not in self.gone:
                self.gone[rank] = ch.closed
                self.receiver.rank_gone(rank, ch.closed)

    @property
    def pending_requests(self) -> int:
        """Requests registered and not yet handed back."""
        return self.receiver.pending_requests

    def counters(self) -> dict:
        """What the side channel refused and dropped (``MooncakeReceiver.counters``), and the
        connections refused before their hello."""
        return {**self.receiver.counters(), "refused_connections": self.refused_connections}

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
        if workers < 1 or max_batch < 1:
            raise InvalidArgumentError(f"workers ({workers}) and max_batch ({max_batch}) must be at least 1")
        self.pool = pool
        #: Descriptors per Mooncake batch (a chunk of more is posted in several, in turn).
        self.max_batch = max_batch
        self._own_engine = engine is None
        self.engine = engine or Engine(decode[0])
        self.channel = _Channel(socket.create_connection(decode, timeout=CONNECT_TIMEOUT))
        self._reader = _k.SideReader()
        self.channel.send(_k.side_frame({"t": "hi", "rank": pool.rank, "shape": _k.side_shape(pool.geometry)}))
        hello = _first_frame_sync(self.channel, self._reader, CONNECT_TIMEOUT)
        if hello["t"] != "hello":
            self.channel.close("refused")
            raise TransferError(f"the decode side refused rank {pool.rank}: {hello.get('why', hello['t'])}")
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
        #: Requests the decode side gave up, by request: answered (``aborted``) once no transfer
        #: of theirs is in flight.
        self._aborts: dict[int, str] = {}
        #: What the decode side sent that this side refused: ``frames`` (a violation, which
        #: closes the channel), ``frees`` (a slot free naming a chunk its slot does not hold),
        #: ``registrations`` (answered with a failed status).
        self.refused = {"frames": 0, "frees": 0, "registrations": 0}
        #: Seconds spent in the engine's post calls alone (``stats()["post_seconds"]`` adds
        #: kvshard's planning and the packing launch, which on the CPU twin runs the copy).
        self.engine_post_seconds = 0.0

    @property
    def gone(self) -> str | None:
        """Why the decode side is gone, or None."""
        return self.channel.closed

    def _read(self) -> None:
        frames = self._reader.feed(self.channel.read())
        for m in frames:
            if m["t"] == "register":
                self._register(m)
            elif m["t"] == "free":
                try:
                    self.sender.bounce_free(m["slot"], request=m["request"], chunk=m["chunk"])
                except InvalidArgumentError:
                    self.refused["frees"] += 1
            elif m["t"] == "abort":
                self._abort(m["request"], m["reason"])
            else:
                self._violation(f"the decode side sent {m['t']}")
                return
        if self._reader.error:
            self._violation(self._reader.error)

    def _violation(self, why: str) -> None:
        """The decode side broke the protocol: the channel closes, as if it were gone."""
        self.refused["frames"] += 1
        self.channel.close(f"protocol violation: {why}")

    def _register(self, m: dict) -> None:
        request = m["request"]
        try:
            reg = _k.Registration(request, self._layout, m["pages"], m["state_pages"], m["prefix_pages"])
            self.sender.open(reg)
        except (InvalidArgumentError, TransferError) as e:
            # Told, as the rank's last status for it: the decode side fails it at once.
            self.refused["registrations"] += 1
            failed = _k.ChunkStatus.failed(request, self.pool.rank, 0, f"registration refused: {e}")
            self._send(_k.side_frame({"t": "status", "status": failed}))
            return
        self.registrations[request] = reg

    def _abort(self, request: int, reason: str) -> None:
        """The decode side gave ``request`` up: nothing more is sent of it, and once none of
        its transfers is in flight this side says so (``aborted``)."""
        self.registrations.pop(request, None)
        with contextlib.suppress(TransferError):
            self.sender.abort(request, reason)
        self._aborts[request] = reason

    def _send(self, data: bytes) -> None:
        with contextlib.suppress(TransferError):
            self.channel.send(data)  # a failure closes the channel: the decode side is gone

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
        # A bounced chunk that landed names its slot, which the decode frees once scattered
        # (a failed chunk's is freed here).
        frame = chunk.report(status) if chunk is not None else _k.side_frame({"t": "status", "status": status})
        self._send(frame)

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
        self._answer_aborts()
        if self.gone:
            # No decode side scatters a slot any more: each whose chunk the engine is done with
            # may take a chunk again (for a decode met later).
            for slot in range(self.sender.bounce_slots):
                with contextlib.suppress(InvalidArgumentError):
                    self.sender.bounce_free(slot)
        return out

    def _answer_aborts(self) -> None:
        """Says ``aborted`` for each request the decode gave up once none of its transfers is
        in flight here (every status of it this side sends is out before)."""
        moving = {f.chunk.request for f in self._flights}
        for request in [r for r in self._aborts if r not in moving]:
            del self._aborts[request]
            # The slots its chunks still hold: the decode frees those whose statuses it never got.
            held = self.sender.held_slots(request)
            self._send(_k.side_frame({"t": "aborted", "request": request, "held": held}))

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
