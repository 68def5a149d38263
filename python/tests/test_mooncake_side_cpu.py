"""The Mooncake side channel against bad peers, on the CPU: a real ``MooncakeDecode`` (and a
real ``MooncakePrefill``) facing raw sockets that send what a broken or hostile peer would. A
malformed, truncated, oversize or unknown frame is refused and counted and its connection
closed, and that rank's requests fail at once (nothing waits for a deadline); statuses are
checked before use (rank, slot, sections) and those of requests never registered are dropped
and counted, never buffered; the good statuses read with a bad frame are kept; a client that
says nothing keeps no rank out of ``accept_sync``.

Each case is a regression test of the side channel as it was (length-prefixed JSON read in
Python: one bad frame wedged every later ``poll``, a missing field lost the statuses read with
it, a negative slot scattered another chunk's bytes, a silent client blocked ``accept_sync``,
any announced length and any unknown status was buffered). They need ``mooncake.engine``
(``mooncake-transfer-engine-non-cuda``): without it they say SKIPPED, or fail when
``KVSHARD_REQUIRE_MOONCAKE`` is set (CI sets it)."""

import socket
import struct
import sys
import threading
import time
from pathlib import Path

import pytest

import kvshard
from kvshard import mooncake

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import mooncake_procs as procs  # noqa: E402
from test_mooncake_cpu import mooncake_loads  # noqa: E402

#: How soon a rank that broke the protocol fails its requests: at once (a poll or two), far
#: below the requests' deadline.
FAILED_WITHIN = 2.0
DEADLINE = 60.0
SLOTS = 2


def frame(msg):
    return mooncake.side_frame(msg)


def hi(rank):
    return frame({"t": "hi", "rank": rank, "shape": mooncake.side_shape(procs.geometry())})


def status(request, rank, chunk, last=True, **bounced):
    return frame({"t": "status", "status": kvshard.transfer.ChunkStatus.sent(request, rank, chunk, last), **bounced})


class Peer:
    """A raw prefill rank: a socket that says hi and reads the hello."""

    def __init__(self, address, rank=None):
        self.sock = socket.create_connection(address, timeout=10)
        self.reader = mooncake.SideReader()
        self.frames = []
        if rank is not None:
            self.sock.sendall(hi(rank))

    def hello(self):
        while not self.frames:
            self.frames += self.reader.feed(self.sock.recv(1 << 16))
        return self.frames.pop(0)

    def send(self, data):
        self.sock.sendall(data)

    def closed_by_peer(self, within=FAILED_WITHIN):
        """Whether the other side closed the connection within ``within`` seconds."""
        self.sock.settimeout(within)
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    return True
        except (TimeoutError, socket.timeout):
            return False
        except OSError:
            return True


def decode_with(peers=2, **kw):
    """A decode for ``procs.N`` ranks with raw peers for ranks ``0..peers`` (joined)."""
    dev = kvshard.Device.cpu()
    pool = procs.decode_pool(dev)
    dec = mooncake.MooncakeDecode(pool, procs.N, bounce_pages=procs.BOUNCE_PAGES, bounce_slots=SLOTS, deadline=DEADLINE, **kw)
    t = threading.Thread(target=dec.accept_sync, kwargs={"timeout": 20})
    t.start()
    ps = [Peer(dec.address, r) for r in range(peers)]
    for p in ps:
        assert p.hello()["t"] == "hello"
    t.join()
    return dec, ps


def register(dec, request, pages=2):
    layout = kvshard.pool.PoolLayout.packed(procs.geometry(), procs.DECODE_PAGES)
    kv = list(range(10 * request, 10 * request + pages))
    dec.register(kvshard.transfer.Registration(request, layout, kv, kv))


def finish(dec, requests, within=FAILED_WITHIN):
    """Polls until ``requests`` have finished (or ``within`` passed): {request: Finished}."""
    done = {}
    end = time.monotonic() + within
    while not set(requests) <= set(done) and time.monotonic() < end:
        finished, overdue = dec.poll()
        assert not overdue
        done.update((f.request, f) for f in finished)
        time.sleep(0.001)
    return done


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(b"\x05\x00\x00\x00{bad}" + b"\x00" * 8, id="garbage"),
        pytest.param(b"KVSM\x01\x00\x00\x00" + struct.pack("<I", 3) + b"\xff\xff\xff", id="unknown-frame"),
        pytest.param(b"KVSM\x01\x00\x00\x00" + struct.pack("<I", 1 << 30), id="oversize"),
        pytest.param(b"KVSM\x02\x00\x00\x00" + struct.pack("<I", 1) + b"\x00", id="other-version"),
    ],
)
def test_a_bad_frame_closes_its_rank_and_fails_its_requests_at_once_and_poll_goes_on(bad):
    mooncake_loads()
    dec, (p0, p1) = decode_with()
    try:
        register(dec, 1)
        register(dec, 2)
        p1.send(bad)
        # Rank 0's statuses still arrive, after rank 1 broke the protocol.
        p0.send(status(1, 0, 0) + status(2, 0, 0))
        done = finish(dec, [1, 2])
        assert set(done) == {1, 2}, "a request waited for a rank that broke the protocol"
        for f in done.values():
            assert not f.completed and {r for r, _, _ in f.failures} == {1}, f.failures
        assert "protocol violation" in dec.gone[1] and 0 not in dec.gone
        assert dec.counters()["refused_frames"] == 1
        assert p1.closed_by_peer(), "the connection of the bad frame stays open"
        # Every later poll works, and later requests fail at once for the gone rank.
        register(dec, 3)
        p0.send(status(3, 0, 0))
        assert not finish(dec, [3])[3].completed
        assert dec.pending_requests == 0
    finally:
        dec.close()


def test_a_truncated_frame_then_the_end_fails_the_rank_at_once():
    mooncake_loads()
    dec, (p0, p1) = decode_with()
    try:
        register(dec, 1)
        whole = status(1, 1, 0)
        p1.send(whole[: len(whole) - 3])
        p1.sock.close()
        p0.send(status(1, 0, 0))
        done = finish(dec, [1])
        assert not done[1].completed and {r for r, _, _ in done[1].failures} == {1}
    finally:
        dec.close()


def test_the_good_statuses_read_with_a_bad_frame_are_kept():
    mooncake_loads()
    dec, (p0, p1) = decode_with()
    try:
        register(dec, 1)
        register(dec, 2)
        # One write: rank 0's last status of request 1, then a frame cut short inside (a status
        # missing its fields), then what would have followed.
        bad = bytearray(status(2, 0, 0))
        bad[8:12] = struct.pack("<I", 4)
        p0.send(status(1, 0, 0) + bytes(bad[:16]) + status(2, 0, 0))
        p1.send(status(1, 1, 0) + status(2, 1, 0))
        done = finish(dec, [1, 2])
        assert done[1].completed, "the good status read with the bad frame was lost"
        assert not done[2].completed and {r for r, _, _ in done[2].failures} == {0}
        assert dec.counters()["refused_frames"] == 1
    finally:
        dec.close()


@pytest.mark.parametrize("case", ["slot-out-of-range", "slot-busy", "page-outside-the-pool", "too-many-pages"])
def test_a_bounced_status_is_checked_before_any_byte_is_scattered(case):
    mooncake_loads()
    dec, (p0, p1) = decode_with()
    try:
        before = dec.pool.snapshot_sync()
        register(dec, 1, pages=4)
        register(dec, 2, pages=4)
        section = [([0], [11])]
        if case == "slot-out-of-range":
            p1.send(status(1, 1, 0, slot=SLOTS, sections=section))
        elif case == "slot-busy":
            # Both before the decode polls: the slot still holds the first when the second
            # names it.
            p1.send(status(1, 1, 0, last=False, slot=0, sections=section) + status(2, 1, 0, slot=0, sections=[([0], [21])]))
        elif case == "page-outside-the-pool":
            p1.send(status(1, 1, 0, slot=0, sections=[([0], [procs.DECODE_PAGES])]))
        else:
            pages = list(range(1, procs.BOUNCE_PAGES + 2))
            p1.send(status(1, 1, 0, slot=0, sections=[([0], pages)]))
        p0.send(status(1, 0, 0) + status(2, 0, 0))
        done = finish(dec, [1, 2])
        assert set(done) == {1, 2}
        assert all(not f.completed and {r for r, _, _ in f.failures} == {1} for f in done.values())
        assert "protocol violation" in dec.gone[1]
        snap = dec.pool.snapshot_sync()
        if case != "slot-busy":  # (its first status was good, and scattered)
            assert snap == before, "bytes were scattered from a status that did not check"
        assert dec.receiver.busy_slots(1) == 0
    finally:
        dec.close()


def test_statuses_of_requests_never_registered_are_dropped_and_counted_not_buffered():
    mooncake_loads()
    dec, (p0, p1) = decode_with()
    try:
        flood = b"".join(status(1000 + i, 0, 0) for i in range(5000))
        p0.send(flood)
        # A bounced one: its slot is freed, naming exactly that chunk.
        p0.send(status(99, 0, 3, slot=1, sections=[([0], [5])]))
        end = time.monotonic() + 10
        while dec.counters()["dropped_statuses"] < 5001 and time.monotonic() < end:
            dec.poll()
        c = dec.counters()
        assert c["dropped_statuses"] == 5001 and c["freed_for_dropped"] == 1 and c["refused_frames"] == 0
        assert dec.pending_requests == 0 and not dec.gone
        frees = []
        p0.sock.settimeout(2)
        while not frees:
            frees += [f for f in p0.reader.feed(p0.sock.recv(1 << 16)) if f["t"] == "free"]
        assert frees == [{"t": "free", "slot": 1, "request": 99, "chunk": 3}]
        # The rank is still served.
        register(dec, 1)
        p0.send(status(1, 0, 0))
        p1.send(status(1, 1, 0))
        assert finish(dec, [1])[1].completed
    finally:
        dec.close()


def test_statuses_waiting_for_an_earlier_chunk_are_bounded():
    mooncake_loads()
    dec, (p0, p1) = decode_with()
    try:
        register(dec, 1)
        # Chunks 1, 2, ... of request 1, never chunk 0: past the bound, a violation.
        p1.send(b"".join(status(1, 1, c, last=False) for c in range(1, 1100)))
        p0.send(status(1, 0, 0))
        done = finish(dec, [1], within=10)
        assert not done[1].completed and "protocol violation" in dec.gone[1]
        assert dec.counters()["refused_frames"] == 1
    finally:
        dec.close()


def test_a_duplicated_and_a_reordered_status_still_complete_the_request():
    mooncake_loads()
    dec, (p0, p1) = decode_with()
    try:
        register(dec, 1, pages=4)
        p0.send(status(1, 0, 1) + status(1, 0, 0, last=False) + status(1, 0, 0, last=False))
        p1.send(status(1, 1, 0) + status(1, 1, 0))
        done = finish(dec, [1])
        assert done[1].completed
        assert dec.counters()["dropped_statuses"] >= 2 and not dec.gone
    finally:
        dec.close()


def test_a_client_that_says_nothing_keeps_no_rank_out_of_accept_sync():
    mooncake_loads()
    dev = kvshard.Device.cpu()
    dec = mooncake.MooncakeDecode(procs.decode_pool(dev), procs.N, bounce_pages=procs.BOUNCE_PAGES)
    try:
        result = {}

        def accept():
            t0 = time.monotonic()
            dec.accept_sync(timeout=30, hello_timeout=30)
            result["took"] = time.monotonic() - t0

        t = threading.Thread(target=accept)
        t.start()
        silent = [Peer(dec.address) for _ in range(3)]
        time.sleep(0.2)
        peers = [Peer(dec.address, r) for r in range(procs.N)]
        for p in peers:
            assert p.hello()["t"] == "hello"
        t.join(timeout=10)
        assert not t.is_alive(), "accept_sync waited for a client that said nothing"
        assert result["took"] < 10
        assert all(s.closed_by_peer() for s in silent)
        assert dec.counters()["refused_connections"] == 3
    finally:
        dec.close()


def test_a_silent_client_is_closed_at_its_own_hello_deadline():
    mooncake_loads()
    dev = kvshard.Device.cpu()
    dec = mooncake.MooncakeDecode(procs.decode_pool(dev), procs.N, bounce_pages=procs.BOUNCE_PAGES)
    try:
        t = threading.Thread(target=dec.accept_sync, kwargs={"timeout": 20, "hello_timeout": 0.5})
        t.start()
        silent = Peer(dec.address)
        assert silent.closed_by_peer(within=5.0), "a silent client kept its connection past its hello deadline"
        for p in [Peer(dec.address, r) for r in range(procs.N)]:
            assert p.hello()["t"] == "hello"
        t.join(timeout=10)
        assert not t.is_alive()
    finally:
        dec.close()


def test_a_hi_of_another_shape_a_rank_out_of_range_or_taken_is_refused():
    mooncake_loads()
    dev = kvshard.Device.cpu()
    dec = mooncake.MooncakeDecode(procs.decode_pool(dev), procs.N, bounce_pages=procs.BOUNCE_PAGES)
    try:
        t = threading.Thread(target=dec.accept_sync, kwargs={"timeout": 20})
        t.start()
        other = kvshard.geometry.CacheGeometry(kvshard.geometry.PoolGeometry(kvshard.geometry.LatentLayout.BF16, 2))
        wrong = Peer(dec.address)
        wrong.send(frame({"t": "hi", "rank": 0, "shape": mooncake.side_shape(other)}))
        assert wrong.hello()["t"] == "refused"
        for rank in (procs.N, 0, 0):
            Peer(dec.address, rank).hello()
        Peer(dec.address, 1).hello()
        t.join(timeout=10)
        assert sorted(dec.channels) == [0, 1] and dec.counters()["refused_connections"] == 3
    finally:
        dec.close()


def test_a_prefill_refuses_a_bad_frame_and_a_free_of_another_chunk():
    mooncake_loads()
    dev = kvshard.Device.cpu()
    server = socket.create_server(("127.0.0.1", 0))
    dst = procs.decode_pool(dev)
    _, bases = kvshard.transfer.engine_memory(dst)
    bounce = kvshard.transfer.BounceBuffer(dev, dst.geometry, procs.BOUNCE_PAGES)
    result = {}

    def decode_side():
        conn, _ = server.accept()
        r = mooncake.SideReader()
        frames = []
        while not frames:
            frames += r.feed(conn.recv(1 << 16))
        result["hi"] = frames[0]
        conn.sendall(frame({"t": "hello", "engine": "127.0.0.1:1", "bases": bases, "pages": procs.DECODE_PAGES,
                            "bounce": [(bounce.address, bounce.bytes)]}))
        result["conn"] = conn

    t = threading.Thread(target=decode_side)
    t.start()
    pool, _keep = procs.prefill_pool(dev, 7, 0)
    pre = mooncake.MooncakePrefill(pool, server.getsockname()[:2], mode=kvshard.transfer.MooncakeMode.BOUNCE,
                                   bounce_pages=procs.BOUNCE_PAGES)
    t.join()
    conn = result["conn"]
    try:
        assert result["hi"]["rank"] == 0
        reg, src, chunks = procs.requests(7)[0]
        conn.sendall(frame({"t": "register", "request": reg.request, "prefix_pages": reg.prefix_pages,
                            "pages": reg.pages, "state_pages": reg.state_pages}))
        while not pre.take_registrations():
            time.sleep(0.001)
        chunk = pre.sender.send(reg.request, src, chunks[0][0], last=False)
        assert chunk.bounced and chunk.slot == 0
        chunk.posted(0.0)
        chunk.landed(0.0)
        assert chunk.poll() is not None
        # A free naming another chunk than the slot holds is refused and counted.
        conn.sendall(frame({"t": "free", "slot": 0, "request": reg.request, "chunk": 5}))
        end = time.monotonic() + 2
        while pre.refused["frees"] == 0 and time.monotonic() < end:
            pre.progress()
        assert pre.refused["frees"] == 1 and pre.sender.bounce_slots_free == 0
        conn.sendall(frame({"t": "free", "slot": 0, "request": reg.request, "chunk": chunk.chunk}))
        while pre.sender.bounce_slots_free == 0 and time.monotonic() < end:
            pre.progress()
        assert pre.sender.bounce_slots_free == 1
        # Garbage from the decode side closes the channel: the decode side is gone.
        conn.sendall(b"\x00" * 16)
        while not pre.gone and time.monotonic() < end:
            pre.progress()
        assert pre.gone and "protocol violation" in pre.gone and pre.refused["frames"] == 1
    finally:
        conn.close()
        pre.close()
        server.close()


def test_a_dense_status_round_trips_and_one_contradicting_itself_is_never_sent():
    """A decode context-parallel rank's status frame (``dense_status``, docs/dcp.md "Mooncake")
    as its dict, both ways; one the protocol refuses raises before any byte is sent."""
    msg = {
        "t": "dense_status",
        "status": kvshard.transfer.ChunkStatus.sent(21, 1, 0, False),
        "slot": 1,
        "ranks": 2,
        "interleave": 1,
        "rank": 1,
        "end_token": 300,
        "sections": [([0, 2], [3, 4])],
    }
    (got,) = mooncake.SideReader().feed(frame(msg))
    assert got["t"] == "dense_status" and got["status"].request == 21
    assert [got[k] for k in ("slot", "ranks", "interleave", "rank", "end_token")] == [1, 2, 1, 1, 300]
    assert [(list(c), list(p)) for c, p in got["sections"]] == [([0, 2], [3, 4])]
    for bad in [{"rank": 2}, {"sections": []}, {"sections": [([0, 0], [1])]}, {"sections": [([0], [])]}]:
        with pytest.raises(kvshard.error.InvalidArgumentError):
            frame({**msg, **bad})
    with pytest.raises(kvshard.error.InvalidArgumentError):
        frame({**msg, "status": kvshard.transfer.ChunkStatus.failed(21, 1, 0, "x")})
