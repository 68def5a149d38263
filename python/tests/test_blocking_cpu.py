"""The naming rule for blocking calls (docs/design.md, "Blocking calls"): a call that can block
the host is named ``_sync`` (or is ``synchronize``), and every such name can block. Checked on
the stub (``kvshard/_kvshard.pyi``, itself checked against the extension by stubtest) against
the list of blocking calls below, and at run time with ``kvshard.host_waits()`` on the CPU
backend in adversarial stream order (``Device.cpu(order="adversarial", seed=...)``)."""

import ast
from pathlib import Path

import pytest

import kvshard
from kvshard.copy import RemoteSpace
from kvshard.error import InvalidArgumentError
from kvshard.geometry import CacheGeometry, Component, LatentLayout, PoolGeometry
from kvshard.hicache import CacheNode
from kvshard.pool import ChunkStaging, HostLayout, PoolLayout
from kvshard.shard import Placement
from kvshard.transfer import Registration, Sender
from conftest import PAGE, engine_tensors, wrap

STUB = Path(kvshard.__file__).with_name("_kvshard.pyi")

# Every call of the extension that can block the calling thread: on a stream or an event, on
# a chunk landing, on a HiCache backup or load, on storage I/O.
BLOCKING = {
    "wait_for_frees_sync",
    "Device.synchronize",
    "Stream.synchronize",
    "Event.synchronize",
    "DevicePool.read_block_sync",
    "DevicePool.read_pages_sync",
    "DevicePool.snapshot_sync",
    "HostPool.snapshot_sync",
    "OwnedRowWrite.run_checked_sync",
    "PendingChunk.wait_sync",
    "PendingChunk.wait_each_sync",
    "MooncakeChunk.wait_sync",
    "HostTransfer.prepare_kernel_sync",
    "HostTransfer.prepare_staged_sync",
    "HiCacheController.evict_sync",
    "HiCacheController.ack_backups_sync",
    "HiCacheController.ack_loads_sync",
    "DiskStore.store_sync",
    "DiskStore.load_sync",
}
# Constructors that wait once while setting up (a constructor has no name to mark), before
# any of the engine's work is queued on what they make.
SETUP = {
    "OwnedRowWrite": "uploads its launch tables once",
    "DiskStore": "zero-fills a new store file once",
}


def stub_calls():
    """Every public function and method the stub declares, as `name` or `Class.name`."""
    tree = ast.parse(STUB.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    out.add(f"{node.name}.{item.name}")
    return {n for n in out if not n.startswith("_") and ".__" not in n or n.endswith(".__new__")}


def named_blocking(name):
    leaf = name.split(".")[-1]
    return leaf.endswith("_sync") or leaf == "synchronize"


def test_every_blocking_call_is_named_sync_and_every_sync_name_blocks():
    calls = stub_calls()
    named = {n for n in calls if named_blocking(n)}
    assert named - BLOCKING == set(), "named _sync in the stub but not listed as blocking"
    assert BLOCKING - named == set(), "listed as blocking but not named _sync in the stub"
    assert {f"{cls}.__new__" for cls in SETUP} <= calls, "a listed constructor is gone"


def small():
    return CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 2))


def test_only_sync_calls_block_the_host_at_run_time():
    """An engine's calls (write, send, poll, backup, the stream's record) add no host wait; each
    `_sync` call that reads or checks what the stream did adds at least one."""
    C = Component
    g, d = small(), kvshard.Device.cpu(order="adversarial", seed=5)
    pages = 8
    pool = wrap(d, g, Placement(1), 0, pages, engine_tensors(g, pages))
    staging = ChunkStaging(pool, PAGE)
    writer = kvshard.pool.OwnedRowWrite(staging, pool)
    host = kvshard.pool.HostPool(d, g, pages, HostLayout.PAGE_FIRST)
    ctl = kvshard.hicache.HiCacheController(pool, host)
    dst = kvshard.pool.DevicePool.allocate(d, g, Placement(1), 0, pages)
    sender = Sender(pool)
    sender.open(
        Registration(1, PoolLayout.of(dst), [3], [3]), RemoteSpace.of(dst)
    )

    def waits(call):
        before = kvshard.host_waits()
        out = call()
        return kvshard.host_waits() - before, out

    asynchronous = [
        lambda: staging.write(C.TARGET_LATENT, 0, bytes([7]) * g.target.row_bytes),
        lambda: writer.run(list(range(PAGE, 2 * PAGE))),
        lambda: ctl.access(CacheNode(3, [1]), None),
        lambda: d.stream().record(),
    ]
    for call in asynchronous:
        assert waits(call)[0] == 0
    n, pending = waits(lambda: sender.send(1, [1], PAGE, last=True))
    assert n == 0
    assert waits(lambda: pending.poll())[0] == 0
    assert waits(lambda: ctl.poll_backups())[0] == 0
    # These wait only for what has not completed yet (here: nothing left, or not).
    ctl.ack_backups_sync(1)
    assert pending.wait_sync().ok
    # These always wait: for the stream to pass what they read or check.
    blocking = [
        lambda: dst.read_block_sync(C.TARGET_LATENT, 0, 3),
        lambda: pool.snapshot_sync(),
        lambda: writer.run_checked_sync(list(range(PAGE, 2 * PAGE))),
        lambda: d.synchronize(),
    ]
    for call in blocking:
        assert waits(call)[0] >= 1, f"the call of line {call.__code__.co_firstlineno} did not wait"


def test_the_cpu_stream_order_is_chosen_from_python():
    for order in ("immediate", "deferred", "adversarial"):
        assert kvshard.Device.cpu(order=order).kind == "cpu"
    assert kvshard.Device.cpu(order="adversarial", seed=9).kind == "cpu"
    with pytest.raises(InvalidArgumentError):
        kvshard.Device.cpu(order="sideways")
    with pytest.raises(InvalidArgumentError):
        kvshard.Device.cpu(order="deferred", seed=1)
