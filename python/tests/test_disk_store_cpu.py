"""``kvshard.storage.DiskStore`` (feature ``nixl``) on the CPU backend, in the adversarial stream order
conftest sets (work runs only when something waits for it, and each host wait runs the other
streams first or last by a seeded coin): the store inside the asynchronous contract (a store
right after a backup queued on another stream persists the new bytes; a load into host pages a
queued device load still reads leaves what that load copies), its bounds (timeouts and writer
counts refused with ``InvalidArgumentError``, never a ``PanicException``), one writer per
directory and rank (the error names the holder), links refused, and a damaged journal record
skipped and counted in ``DiskStats`` (or refused on request).

It needs the NIXL runtime (``scripts/install-nixl.sh`` on LD_LIBRARY_PATH) and a wheel built
with the ``nixl`` feature: without them it skips, or fails when ``KVSHARD_REQUIRE_NIXL`` is set
(CI sets it). Stores go under the build tree (a real filesystem: tmpfs may refuse O_DIRECT)."""

import functools
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import kvshard
from kvshard.copy import Direction, Method
from kvshard.error import StorageError, UnavailableError
from kvshard.geometry import CacheGeometry, LatentLayout, PoolGeometry
from kvshard.hicache import HostTransfer, TransferPlan
from kvshard.pool import HostLayout, HostPool
from kvshard.shard import Placement
from conftest import engine_tensors, nonzero, wrap

PAGES = 8
POISON = 0xA5


def geometry():
    return CacheGeometry(
        PoolGeometry(LatentLayout.FP8_TRTLLM, indexer_layers=[True, False]), draft=True
    )


def scratch_base():
    target = Path(__file__).resolve().parents[2] / "target"
    return target if target.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def host_pool(device=None):
    device = device or kvshard.Device.cpu()
    host = HostPool(device, geometry(), PAGES, HostLayout.PAGE_FIRST_DIRECT)
    for i in range(len(host.buffer_layouts())):
        np.from_dlpack(host.buffer_view(i, raw=True))[...] = POISON
    return host


@functools.cache
def nixl_runtime_missing():
    d = scratch_base() / "storage-tests-py" / "disk-store-probe"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    try:
        kvshard.storage.DiskStore(host_pool(), d / "s", 1)
    except UnavailableError as e:
        return str(e)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return None


def need_nixl(what):
    if not hasattr(kvshard.storage, "DiskStore"):
        msg = f"{what}: this wheel has no storage tier (built without --features nixl)"
    elif (missing := nixl_runtime_missing()) is not None:
        msg = f"{what}: NIXL runtime missing: {missing}"
    else:
        return
    if os.environ.get("KVSHARD_REQUIRE_NIXL"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture
def store_dir(request):
    need_nixl(request.node.name)
    d = scratch_base() / "storage-tests-py" / request.node.name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def key(i):
    return bytes([i]) * 64


def page(host, p):
    """Every byte of host page ``p``, buffer by buffer."""
    out = []
    for i in range(len(host.buffer_layouts())):
        raw = np.from_dlpack(host.buffer_view(i, raw=True)).reshape(-1)
        for offset, n in host.page_spans(i, p):
            out.append(raw[offset : offset + n].tobytes())
    return b"".join(out)


def device_pool(device, rng):
    g = geometry()
    tensors = engine_tensors(g, PAGES)
    for arrays in tensors.values():
        for a in arrays:
            a[...] = nonzero(rng, a.shape)
    return wrap(device, g, Placement(1), 0, PAGES, tensors)


def transfer(pool, host, device_pages, host_pages, direction):
    plan = TransferPlan(Placement(1), 0, device_pages, host_pages, PAGES, PAGES)
    return HostTransfer(pool, host, plan, direction)


# Old behaviour: store_sync right after a backup queued on another stream read the host pages
# at once and persisted their old bytes with a valid checksum; a later load said LOADED.
def test_a_store_persists_what_a_backup_still_queued_writes(store_dir, rng):
    d = kvshard.Device.cpu()
    pool = device_pool(d, rng)
    host = host_pool(d)
    store = kvshard.storage.DiskStore(host, store_dir / "s", 8)
    backup = transfer(pool, host, [3, 4], [1, 2], Direction.BACKUP)
    other = d.new_stream()
    backup.run(other, Method.COPY_ENGINE)
    assert store.store_sync([(key(1), 1), (key(2), 2)]).written == 2
    other.synchronize()
    backed = [page(host, p) for p in (1, 2)]
    assert all(b != bytes([POISON]) * len(b) for b in backed), "the backup ran"
    assert store.load_sync([(key(1), 5), (key(2), 6)]) == [kvshard.storage.LoadOutcome.LOADED] * 2
    assert page(host, 5) == backed[0] and page(host, 6) == backed[1]


# Old behaviour: load_sync into host pages a queued load to the device still read wrote them at
# once: the device load copied the storage's bytes instead of the host's.
def test_a_load_from_storage_leaves_what_a_queued_device_load_reads(store_dir, rng):
    d = kvshard.Device.cpu()
    pool = device_pool(d, rng)
    host = host_pool(d)
    store = kvshard.storage.DiskStore(host, store_dir / "s", 8)
    # Host page 1 holds A, storage holds B (from page 3).
    for i in range(len(host.buffer_layouts())):
        raw = np.from_dlpack(host.buffer_view(i, raw=True)).reshape(-1)
        for (o1, n), (o3, _) in zip(host.page_spans(i, 1), host.page_spans(i, 3)):
            raw[o1 : o1 + n] = nonzero(rng, n)
            raw[o3 : o3 + n] = nonzero(rng, n)
    a, b = page(host, 1), page(host, 3)
    store.store_sync([(key(9), 3)])
    load = transfer(pool, host, [4], [1], Direction.LOAD)
    other = d.new_stream()
    load.run(other, Method.COPY_ENGINE)
    assert store.load_sync([(key(9), 1)]) == [kvshard.storage.LoadOutcome.LOADED]
    other.synchronize()
    assert page(host, 1) == b
    back = transfer(pool, host, [4], [7], Direction.BACKUP)
    back.run(None, Method.COPY_ENGINE)
    d.synchronize()
    assert page(host, 7) == a, "the queued device load copied bytes loaded after it"


# Old behaviour: writers=2**32-1 aborted the interpreter; a timeout too large for a deadline
# raised a PanicException (which SGLang's storage thread does not catch).
@pytest.mark.parametrize(
    "kwargs",
    [
        {"writers": 2**32 - 1},
        {"writers": 2**20},
        {"writer": 3, "writers": 2},
        {"timeout": float("inf")},
        {"timeout": float("nan")},
        {"timeout": -1.0},
        {"timeout": 0.0},
        {"timeout": 1e300},
        {"timeout": 1.8e19},
        {"timeout": 1e12},
        {"staging_slots": 1 << 40},
        {"damaged": "ignore"},
    ],
)
def test_settings_out_of_bounds_are_invalid_argument_errors(store_dir, kwargs):
    with pytest.raises(kvshard.error.InvalidArgumentError):
        kvshard.storage.DiskStore(host_pool(), store_dir / "s", 4, **kwargs)
    assert not (store_dir / "s" / "w0000.journal").exists()


# Old behaviour: a second DiskStore of the same directory and writer succeeded, and the two
# overwrote each other's slots and journal records silently.
def test_one_writer_per_directory_and_rank(store_dir):
    host = host_pool()
    first = kvshard.storage.DiskStore(host, store_dir / "s", 4, writers=2)
    with pytest.raises(StorageError) as e:
        kvshard.storage.DiskStore(host, store_dir / "s", 4, writers=2)
    assert e.value.failure == "locked" and e.value.holder == os.getpid()
    reader = kvshard.storage.DiskStore(host, store_dir / "s", 4, writers=2, read_only=True)
    assert reader.snapshot().records == [0, 0]
    del first
    kvshard.storage.DiskStore(host, store_dir / "s", 4, writers=2)


def test_links_in_the_directory_are_refused(store_dir):
    victim = store_dir / "victim"
    victim.write_bytes(b"outside")
    s = store_dir / "s"
    s.mkdir()
    (s / "w0000.slots").symlink_to(victim)
    with pytest.raises(StorageError) as e:
        kvshard.storage.DiskStore(host_pool(), s, 4)
    assert e.value.failure == "untrusted" and e.value.holder is None
    assert victim.read_bytes() == b"outside"


# Old behaviour: a record failing its checksum in the middle of a journal was cut with
# everything after it at the next open, silently.
def test_a_damaged_journal_record_is_counted_and_nothing_after_it_lost(store_dir):
    host = host_pool()
    store = kvshard.storage.DiskStore(host, store_dir / "s", 8)
    store.store_sync([(key(i), i) for i in range(1, 5)])
    del store
    journal = store_dir / "s" / "w0000.journal"
    data = bytearray(journal.read_bytes())
    data[64 + 96 + 30] ^= 1  # record 1 of 4
    journal.write_bytes(bytes(data))
    store = kvshard.storage.DiskStore(host, store_dir / "s", 8)
    stats = store.stats()
    assert stats.damaged_records == 1 and stats.as_dict()["damaged_records"] == 1
    snap = store.snapshot()
    assert store.exists([key(i) for i in range(1, 5)], snap) == [True, False, True, True]
    del store
    with pytest.raises(StorageError) as e:
        kvshard.storage.DiskStore(host, store_dir / "s", 8, damaged="refuse")
    assert e.value.failure == "corrupt"
    assert journal.read_bytes() == bytes(data)
