"""Nothing P/D waits forever, from Python: every request the ``Receiver`` tracks has a
deadline, and ``expire()`` reports each one whose deadline passed first; a ``PendingChunk``
dropped before its status was taken fails its request, and ``Sender.take_dropped()`` hands out
the status the decode side must hear. And every kvshard error reaches Python as its exception
class (``python/src/errors.rs`` maps each one, exhaustively)."""

import gc
import math

import pytest

import kvshard
from kvshard.copy import RemoteSpace
from kvshard.error import (
    ChunkFailedError,
    InvalidArgumentError,
    TransferDeadlineError,
    TransferError,
)
from kvshard.geometry import CacheGeometry, LatentLayout, PoolGeometry
from kvshard.pool import DevicePool, PoolLayout
from kvshard.shard import Placement, RequestChain, ShardAllocator
from kvshard.transfer import ChunkStatus, DEFAULT_DEADLINE, Registration
from conftest import PAGE

PAGES = 8


def setup(ranks=1):
    g = CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 2))
    d = kvshard.Device.cpu()
    unsharded = Placement(1)
    src = DevicePool.allocate(d, g, unsharded, 0, PAGES)
    dst = DevicePool.allocate(d, g, unsharded, 0, PAGES)
    reg = Registration(4, PoolLayout.of(dst), [1, 2, 3], [1, 2, 3])
    return src, dst, reg


def test_an_overdue_request_is_reported_once_and_finishes_failed():
    src, dst, reg = setup()
    assert DEFAULT_DEADLINE == 300.0 and kvshard.transfer.Receiver().deadline == 300.0
    rx = kvshard.transfer.Receiver(deadline=60.0)
    rx.register(reg, 2, deadline=0.0)  # due at once; ranks 0 and 1 send it
    sender = kvshard.transfer.Sender(src)
    sender.open(reg, RemoteSpace.of(dst))
    # Rank 0 reports its first chunk; nobody reports the rest.
    assert rx.receive(sender.send(4, [1], PAGE, last=False).wait_sync()) is None
    assert rx.progress(4) == (2, 0, False, False)
    (overdue,) = rx.expire()
    assert (overdue.request, overdue.ranks, overdue.deadline) == (4, 2, 0.0)
    assert overdue.missing == [(0, 1), (1, 0)]
    assert "no last status within its deadline" in str(overdue)
    assert rx.expire() == []  # reported once
    assert rx.progress(4) == (2, 0, True, True)
    # The pages stay held until every rank has reported: rank 0 is aborted, rank 1's process
    # is gone (answered for with a failed status at the chunk it owes).
    assert rx.receive(sender.abort(4, "decode gave up")) is None
    done = rx.receive(ChunkStatus.failed(4, 1, 0, "process gone"))
    assert done is not None and not done.completed and rx.pending_requests == 0
    # The receiver's own deadline applies to requests registered without one.
    rx.register(reg, 1)
    assert rx.expire() == [] and rx.deadline == 60.0
    rx.deadline = 0.0
    rx.register(Registration(5, reg.layout, [1], [1]), 1)
    assert [o.request for o in rx.expire()] == [5]


def test_a_deadline_is_seconds_that_fit():
    _, _, reg = setup()
    for bad in [-1.0, math.nan, math.inf]:
        with pytest.raises(InvalidArgumentError, match="deadline"):
            kvshard.transfer.Receiver(deadline=bad)
        with pytest.raises(InvalidArgumentError, match="deadline"):
            kvshard.transfer.Receiver().register(reg, 1, deadline=bad)
    rx = kvshard.transfer.Receiver()
    with pytest.raises(InvalidArgumentError):
        rx.deadline = -2.0
    assert rx.deadline == 300.0


def test_an_overdue_request_is_a_transfer_deadline_error():
    _, _, reg = setup()
    rx = kvshard.transfer.Receiver(deadline=0.0)
    rx.register(reg, 3)
    (overdue,) = rx.expire()
    with pytest.raises(TransferDeadlineError, match="request 4: no last status") as e:
        raise overdue.error()
    err = e.value
    assert isinstance(err, TransferError) and isinstance(err, TimeoutError)
    assert (err.request, err.ranks, err.deadline) == (4, 3, 0.0)
    assert err.missing == [(0, 0), (1, 0), (2, 0)]


def test_a_dropped_chunk_fails_its_request_with_a_status_to_deliver():
    src, dst, reg = setup()
    rx = kvshard.transfer.Receiver()
    rx.register(reg, 1)
    sender = kvshard.transfer.Sender(src)
    sender.open(reg, RemoteSpace.of(dst))
    assert sender.take_dropped() == []
    sender.send(4, [1, 2], 2 * PAGE, last=False)  # the PendingChunk is dropped unpolled
    gc.collect()
    (status,) = sender.take_dropped()
    assert (status.request, status.rank, status.chunk, status.ok) == (4, 0, 0, False)
    assert "dropped" in status.reason and status.terminal
    assert sender.take_dropped() == [] and sender.pending_requests == 0
    done = rx.receive(status)
    assert done is not None and not done.completed
    # A later send of the request is refused: it is closed.
    with pytest.raises(TransferError, match="not open"):
        sender.send(4, [1, 2, 3], 3 * PAGE, last=True)


def test_a_dropped_chunk_fails_the_next_send_of_its_request():
    src, dst, reg = setup()
    sender = kvshard.transfer.Sender(src)
    sender.open(reg, RemoteSpace.of(dst))
    sender.send(4, [1], PAGE, last=False)
    gc.collect()
    with pytest.raises(ChunkFailedError, match="chunk 0 was dropped") as e:
        sender.send(4, [1, 2], 2 * PAGE, last=False)
    assert e.value.status.chunk == 0 and not e.value.status.ok
    assert sender.take_dropped() == []  # handed out once, by the send


def test_close_ends_a_request_without_a_status():
    src, dst, reg = setup()
    sender = kvshard.transfer.Sender(src)
    sender.open(reg, RemoteSpace.of(dst))
    assert sender.send(4, [1], PAGE, last=False).wait_sync().ok
    sender.close(4)
    assert sender.pending_requests == 0
    with pytest.raises(TransferError, match="cannot close"):
        sender.close(4)


def test_a_stale_or_foreign_chain_is_an_invalid_argument():
    placement = Placement(1)
    alloc = ShardAllocator(placement, PAGES)
    chain = RequestChain(placement)
    chain.grow_to(alloc, 2 * PAGE)
    pages = chain.pages
    with pytest.raises(InvalidArgumentError, match="chain of allocator"):
        chain.grow_to(ShardAllocator(placement, PAGES), 3 * PAGE)
    alloc.free(pages)
    with pytest.raises(InvalidArgumentError, match="stale chain"):
        chain.pages
    with pytest.raises(InvalidArgumentError, match="is not allocated"):
        RequestChain.cached(alloc, 0, pages)
