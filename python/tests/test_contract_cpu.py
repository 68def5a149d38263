"""The Python API's contract on the CPU backend: memory kvshard writes into must be writable and
stay where it is (read-only arrays refused with ``ReadOnlyError``, wrapped NumPy arrays pinned
against ``resize``), a P/D chunk says whether it is the last, and torch's streams and events
are understood without torch: a stand-in module in ``sys.modules`` that has the attributes
kvshard reads of ``torch.cuda`` (``is_initialized``, ``current_stream``, ``Stream.cuda_stream``,
``Event.cuda_event``). On the CPU backend ``stream=None`` never asks torch; the GPU side
(torch's current stream, waits on torch events) is in ``test_gpu.py``, with the real torch."""

import gc
import sys
import types

import numpy as np
import pytest

import kvshard
from kvshard.backend import pending_frees, wait_for_frees_sync
from kvshard.copy import RemoteSpace
from kvshard.geometry import CacheGeometry, Component, LatentLayout, PoolGeometry
from kvshard.hicache import CacheNode, HiCacheController, TransferPlan
from kvshard.pool import ChunkStaging, DevicePool, HostLayout, OwnedRowWrite, PoolLayout
from kvshard.shard import Placement
from kvshard.transfer import Registration, Sender
from conftest import PAGE, engine_tensors, wrap

C = Component
PAGES = 8


def small():
    return CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 2))


def write_page_one(device, geometry, tensors, byte):
    """Wraps `tensors` and persists `byte` into every row of logical page 1 with the owned-row
    write: what a forward pass does to the engine's arrays."""
    pool = wrap(device, geometry, Placement(1), 0, PAGES, tensors)
    staging = ChunkStaging(pool, PAGE)
    for c in geometry.components():
        for layer in range(c.layers):
            np.from_dlpack(staging.layer_view(c.component, layer))[...] = byte
    OwnedRowWrite(staging, pool).run_checked_sync(list(range(PAGE, 2 * PAGE)))
    device.synchronize()
    return pool


def test_a_read_only_memmap_is_refused_and_a_writable_one_written(tmp_path):
    g, d = small(), kvshard.Device.cpu()
    shape = (PAGES * PAGE, 1, 576)
    path = tmp_path / "kv.bin"
    before = bytes(range(256)) * (PAGES * PAGE * 576 // 256)
    path.write_bytes(before)
    tensors = engine_tensors(g, PAGES)
    tensors[C.TARGET_LATENT][1] = np.memmap(path, np.uint8, mode="r", shape=shape)
    # Writing through a read-only mapping would kill the interpreter (SIGSEGV): refused first.
    with pytest.raises(kvshard.error.ReadOnlyError, match="stored layer 1: the tensor is read-only") as e:
        write_page_one(d, g, tensors, 0xAB)
    assert isinstance(e.value, kvshard.error.InvalidArgumentError) and isinstance(e.value, ValueError)
    assert path.read_bytes() == before
    # The same file mapped writable is the engine's memory like any array.
    tensors[C.TARGET_LATENT][1] = np.memmap(path, np.uint8, mode="r+", shape=shape)
    pool = write_page_one(d, g, tensors, 0xAB)
    tensors[C.TARGET_LATENT][1].flush()
    after = path.read_bytes()
    row = 576 * PAGE
    assert after[row : 2 * row] == bytes([0xAB]) * row
    assert after[:row] == before[:row] and after[2 * row :] == before[2 * row :]
    del pool


def test_an_array_over_bytes_is_refused_and_the_bytes_stay_unchanged():
    g, d = small(), kvshard.Device.cpu()
    n = PAGES * PAGE * 576
    immutable = bytes(range(1, 256)) * (n // 255) + bytes(n % 255)
    frozen = np.frombuffer(immutable, np.uint8)
    assert not frozen.flags.writeable
    tensors = engine_tensors(g, PAGES)
    tensors[C.TARGET_LATENT][0] = frozen.reshape(PAGES * PAGE, 1, 576)
    with pytest.raises(kvshard.error.ReadOnlyError, match="read-only"):
        write_page_one(d, g, tensors, 0xCD)
    # A producer with DLPack alone (no buffer protocol, like torch) says read-only through the
    # capsule's READ_ONLY flag; one tensor holding both layers goes through the same check.
    stacked = np.frombuffer(immutable * 2, np.uint8).reshape(2, PAGES * PAGE, 576)
    with pytest.raises(kvshard.error.ReadOnlyError, match="all 2 stored layers"):
        DevicePool.wrap(d, g, Placement(1), 0, PAGES, DlpackOnly(stacked), tensors[C.TARGET_INDEXER])
    assert immutable == bytes(range(1, 256)) * (n // 255) + bytes(n % 255)
    # The same producer of writable memory is accepted.
    writable = np.zeros((2, PAGES * PAGE, 576), np.uint8)
    DevicePool.wrap(d, g, Placement(1), 0, PAGES, DlpackOnly(writable), tensors[C.TARGET_INDEXER])


class DlpackOnly:
    """An array seen through DLPack alone, as kvshard sees a torch or CuPy tensor."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def host_buffers(device, geometry, pages):
    """Zeroed host arrays of the sizes and rows of `HostPool`'s `page_first` buffers."""
    layouts = kvshard.pool.HostPool(device, geometry, pages, HostLayout.PAGE_FIRST).buffer_layouts()
    return [np.zeros((b.bytes // b.row_bytes, b.row_bytes), np.uint8) for b in layouts]


def test_read_only_host_buffers_are_refused():
    g, d = small(), kvshard.Device.cpu()
    bufs = host_buffers(d, g, PAGES)
    kvshard.pool.HostPool.wrap(d, g, PAGES, bufs, HostLayout.PAGE_FIRST)  # writable: accepted
    bufs[1] = bufs[1].copy()
    bufs[1].flags.writeable = False
    with pytest.raises(kvshard.error.ReadOnlyError, match=r"host buffer 1 \(\[TargetIndexer\]\)"):
        kvshard.pool.HostPool.wrap(d, g, PAGES, bufs, HostLayout.PAGE_FIRST)


def resize_refused(array):
    """Whether NumPy refuses to reallocate `array` in place (refcheck=False skips only the
    reference count check)."""
    try:
        array.resize(array.size * 2, refcheck=False)
    except ValueError as e:
        assert "cannot resize" in str(e)
        return True
    return False


def test_a_wrapped_array_cannot_be_resized_while_its_pool_lives():
    g, d = small(), kvshard.Device.cpu()
    tensors = engine_tensors(g, PAGES)
    latent = tensors[C.TARGET_LATENT][1]
    # An array like it is reallocated by resize(refcheck=False), which would leave a pool
    # over it writing into freed memory.
    assert not resize_refused(np.zeros_like(latent))
    pool = wrap(d, g, Placement(1), 0, PAGES, tensors)
    assert resize_refused(latent)
    assert latent.shape == (PAGES * PAGE, 1, 576)
    pool.fill(9)
    d.synchronize()
    assert (latent == 9).all()
    # The hold is the pool's: gone with it.
    del pool
    gc.collect()
    assert not resize_refused(latent)


def test_a_wrapped_host_array_cannot_be_resized_while_its_pool_lives():
    g, d = small(), kvshard.Device.cpu()
    bufs = host_buffers(d, g, PAGES)
    host = kvshard.pool.HostPool.wrap(d, g, PAGES, bufs, HostLayout.PAGE_FIRST)
    assert all(resize_refused(b) for b in bufs)
    host.fill(4)
    d.synchronize()
    assert all((b == 4).all() for b in bufs)
    del host
    gc.collect()
    assert not resize_refused(bufs[0])


def test_send_requires_last_as_a_keyword():
    g, d = small(), kvshard.Device.cpu()
    unsharded = Placement(1)
    src = DevicePool.allocate(d, g, unsharded, 0, PAGES)
    dst = DevicePool.allocate(d, g, unsharded, 0, PAGES)
    reg = Registration(1, PoolLayout.of(dst), [1, 2], [1, 2])
    sender = Sender(src)
    sender.open(reg, RemoteSpace.of(dst))
    with pytest.raises(TypeError, match="last"):
        sender.send(1, [1, 2], 2 * PAGE)
    with pytest.raises(TypeError):
        sender.send(1, [1, 2], 2 * PAGE, True)  # positional: keyword-only
    # Nothing was sent: the request is still open, and the final chunk goes through.
    assert sender.pending_requests == 1
    assert sender.send(1, [1, 2], 2 * PAGE, last=True).wait_sync().last


@pytest.fixture
def fake_torch(monkeypatch):
    """A stand-in `torch` in `sys.modules` with the duck-typed attributes kvshard reads, and
    the list of what was asked of it."""
    asked = []

    class Stream:
        """torch.cuda.Stream's: the raw CUstream as `cuda_stream`."""

        def __init__(self, handle):
            self.cuda_stream = handle

    class Event:
        """torch.cuda.Event's: the raw CUevent as `cuda_event` (0 until first recorded)."""

        def __init__(self, handle=0):
            self.cuda_event = handle

    def is_initialized():
        asked.append("is_initialized")
        return True

    def current_stream(device=None):
        asked.append(("current_stream", device))
        return Stream(0x5000)

    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(
        Stream=Stream, Event=Event, is_initialized=is_initialized, current_stream=current_stream
    )
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch, asked


def test_stream_none_on_the_cpu_backend_never_asks_torch(fake_torch):
    _, asked = fake_torch
    g, d = small(), kvshard.Device.cpu()
    unsharded = Placement(1)
    tensors = engine_tensors(g, PAGES)
    pool = write_page_one(d, g, tensors, 0x5A)
    d.stream()
    assert pool.read_block_sync(C.TARGET_LATENT, 0, 1) == bytes([0x5A]) * (PAGE * 576)
    host = kvshard.pool.HostPool(d, g, PAGES, HostLayout.PAGE_FIRST)
    ctl = HiCacheController(pool, host)
    node = CacheNode(3, [1])
    assert ctl.access(node, None) == 0
    ctl.ack_backups_sync(1)
    handle = ctl.load(3, [2])
    for layer in range(g.model_layers):
        handle.wait_layer(None, layer)
    ctl.ack_loads_sync(1)
    dst = DevicePool.allocate(d, g, unsharded, 0, PAGES)
    sender = Sender(pool)
    sender.open(Registration(1, PoolLayout.of(dst), [3], [3]), RemoteSpace.of(dst))
    assert sender.send(1, [2], PAGE, last=True).wait_sync().ok
    d.synchronize()
    # Page 1 backed up, loaded into page 2, sent into page 3 of another pool: on the arena's
    # default stream throughout, torch never consulted.
    assert dst.read_block_sync(C.TARGET_LATENT, 1, 3) == bytes([0x5A]) * (PAGE * 576)
    assert asked == []


def test_after_understands_torch_events_and_streams(fake_torch):
    torch, asked = fake_torch
    g, d = small(), kvshard.Device.cpu()
    pool = DevicePool.allocate(d, g, Placement(1), 0, PAGES)
    ctl = HiCacheController(pool, kvshard.pool.HostPool(d, g, PAGES, HostLayout.PAGE_FIRST))
    # torch's events and streams are CUDA objects: refused on the CPU backend, each for what
    # it is (a stream of unknown kind would be "a stream must be ...").
    for recorded in [0x1234, 0]:
        with pytest.raises(kvshard.error.InvalidArgumentError, match="a CUDA event .* given to the CPU device"):
            ctl.backup(CacheNode(1, [1]), torch.cuda.Event(recorded))
    with pytest.raises(kvshard.error.InvalidArgumentError, match="a CUDA stream handle .* given to the CPU device"):
        ctl.load(1, [2], torch.cuda.Stream(0x77))
    with pytest.raises(kvshard.error.InvalidArgumentError, match="a stream must be"):
        ctl.backup(CacheNode(1, [1]), object())
    # kvshard's own events and streams are taken on any device.
    compute = d.new_stream()
    pool.fill(6, compute)
    assert ctl.backup(CacheNode(1, [1]), compute.record()) == 0
    assert ctl.backup(CacheNode(2, [2]), compute) == 1
    assert [a.node for a in ctl.ack_backups_sync(2)] == [1, 2]
    assert asked == []


class _Counted:
    """A stream whose handle attribute counts its reads."""

    reads = 0

    def __init__(self, handle):
        self._handle = handle

    @property
    def cuda_stream(self):
        type(self).reads += 1
        return self._handle


class _Protocol:
    """The CUDA stream protocol: `__cuda_stream__()` gives (version, handle)."""

    def __init__(self, value):
        self._value = value

    def __cuda_stream__(self):
        return self._value


class _ProtocolAttribute:
    """The protocol's first draft: `__cuda_stream__` an attribute, not a method."""

    def __init__(self, value):
        self.__cuda_stream__ = value


class _Ptr:
    """CuPy's older stream: the handle as `ptr`."""

    def __init__(self, ptr):
        self.ptr = ptr


class _Both:
    """Both torch's attribute and the protocol: torch's is read first."""

    cuda_stream = 0x11

    def __cuda_stream__(self):
        raise AssertionError("the protocol is not asked when `cuda_stream` answers")


class _Raising:
    """A handle property that fails: its error is the caller's, not "a stream must be"."""

    @property
    def cuda_stream(self):
        raise RuntimeError("stream destroyed")


def test_stream_arguments_name_their_handle_in_every_shape():
    handle = kvshard._kvshard._stream_handle
    assert handle(0) == 0
    assert handle(0x7F00_0000_1234) == 0x7F00_0000_1234
    assert handle(_Counted(0x5000)) == 0x5000
    assert handle(_Protocol((0, 0x6000))) == 0x6000
    assert handle(_ProtocolAttribute((0, 0x6100))) == 0x6100
    assert handle(_Ptr(0x7000)) == 0x7000
    assert handle(_Both()) == 0x11
    with pytest.raises(RuntimeError, match="stream destroyed"):
        handle(_Raising())
    # The attribute that answered is remembered per type; an instance of that type lacking it
    # is probed in full, not refused.
    class Mixed:
        def __init__(self, **attrs):
            self.__dict__.update(attrs)

    assert handle(Mixed(cuda_stream=0x21)) == 0x21
    assert handle(Mixed(ptr=0x22)) == 0x22
    assert handle(Mixed(__cuda_stream__=(0, 0x23))) == 0x23
    assert handle(Mixed(cuda_stream=0x24)) == 0x24
    with pytest.raises(kvshard.error.InvalidArgumentError, match="a stream must be"):
        handle(Mixed())
    for bad in [-1, object(), _Protocol(0x6000), _Protocol((0, -5)), _Counted(None), _Ptr("x"), 1.5]:
        with pytest.raises(kvshard.error.InvalidArgumentError, match="a stream must be"):
            handle(bad)


def test_a_foreign_stream_costs_one_handle_read_per_call():
    """Each call reads the handle once (it is the key of the kept wrapper, and the caller may
    point the same object at another stream): no read is repeated, none cached by identity."""
    handle = kvshard._kvshard._stream_handle
    s = _Counted(0x5000)
    _Counted.reads = 0
    for _ in range(10):
        assert handle(s) == 0x5000
    assert _Counted.reads == 10
    s._handle = 0x5100
    assert handle(s) == 0x5100


def test_foreign_streams_of_every_shape_are_cuda_streams_to_the_cpu_device():
    """On the CPU backend a handle of any shape is refused for what it is, before anything is
    enqueued, and the pool is unchanged."""
    g, d = small(), kvshard.Device.cpu()
    pool = DevicePool.allocate(d, g, Placement(1), 0, PAGES)
    pool.fill(3)
    for s in [_Counted(0x5000), _Protocol((0, 0x6000)), _Ptr(0x7000), 0x8000]:
        with pytest.raises(kvshard.error.InvalidArgumentError, match="a CUDA stream handle .* given to the CPU device"):
            pool.fill(9, s)
    assert pool.read_block_sync(C.TARGET_LATENT, 0, 1) == bytes([3]) * (PAGE * 576)


# Old behaviour: the same array (or overlapping views of one buffer) wrapped as two stored
# layers, or as two pools, was accepted: two usage records over one memory, so kvshard could not
# order the work queued through one after the other's (and two layers wrote the same bytes).
def test_one_memory_is_wrapped_once():
    g, d = small(), kvshard.Device.cpu()
    unsharded = Placement(1)
    tensors = engine_tensors(g, PAGES)
    twice = dict(tensors)
    twice[C.TARGET_LATENT] = [tensors[C.TARGET_LATENT][0]] * 2
    with pytest.raises(kvshard.error.InvalidArgumentError, match="overlaps .*one memory wrapped twice"):
        wrap(d, g, unsharded, 0, PAGES, twice)
    # Overlapping views of one buffer: refused too; distinct views of it are two memories.
    rows = PAGES * PAGE
    buffer = np.zeros((2 * rows + PAGE, 1, 576), np.uint8)
    views = dict(tensors)
    views[C.TARGET_LATENT] = [buffer[:rows], buffer[PAGE : rows + PAGE]]
    with pytest.raises(kvshard.error.InvalidArgumentError, match="overlaps"):
        wrap(d, g, unsharded, 0, PAGES, views)
    views[C.TARGET_LATENT] = [buffer[:rows], buffer[rows : 2 * rows]]
    pool = wrap(d, g, unsharded, 0, PAGES, views)
    # A second pool over memory a live pool wraps, device or host: refused, naming it.
    with pytest.raises(kvshard.error.InvalidArgumentError, match="another kvshard pool wraps: target latent tensor of stored layer 0"):
        wrap(d, g, unsharded, 0, PAGES, views)
    layouts = kvshard.pool.HostPool(d, g, PAGES, HostLayout.PAGE_FIRST).buffer_layouts()
    host = [buffer.reshape(-1)[: b.bytes].reshape(b.bytes // b.row_bytes, b.row_bytes) for b in layouts[:1]]
    host += [np.zeros((b.bytes // b.row_bytes, b.row_bytes), np.uint8) for b in layouts[1:]]
    with pytest.raises(kvshard.error.InvalidArgumentError, match="another kvshard pool wraps"):
        kvshard.pool.HostPool.wrap(d, g, PAGES, host, HostLayout.PAGE_FIRST)
    # Gone with the pool (and its work): the memory may be wrapped again.
    del pool
    gc.collect()
    wrap(d, g, unsharded, 0, PAGES, views)
    kvshard.pool.HostPool.wrap(d, g, PAGES, host, HostLayout.PAGE_FIRST)


def test_memory_with_work_queued_by_a_dropped_pool_is_not_wrapped_again_until_it_ran():
    g, d = small(), kvshard.Device.cpu(order="deferred")
    tensors = engine_tensors(g, PAGES)
    pool = wrap(d, g, Placement(1), 0, PAGES, tensors)
    pool.fill(7)  # queued: the deferred CPU backend runs it when something waits
    del pool
    gc.collect()
    # The pool's work still writes the arrays, so they are still its (and alive).
    assert pending_frees() >= 1
    with pytest.raises(kvshard.error.InvalidArgumentError, match="work still queued"):
        wrap(d, g, Placement(1), 0, PAGES, tensors)
    d.synchronize()
    assert (tensors[C.TARGET_LATENT][0] == 7).all()
    pending_frees()  # the sweep that lets go of what the ran work held
    again = wrap(d, g, Placement(1), 0, PAGES, tensors)
    del again


# Old behaviour: a 2-D slot tensor (or host index array) was read flat, and a float in a list of
# slots was a bare TypeError; every index is now a 1-D integer, anything else an
# InvalidArgumentError naming it (a float is never read as the integer it truncates to).
def test_slots_and_host_indices_are_one_dimensional_integers():
    g, d = small(), kvshard.Device.cpu()
    pool = DevicePool.allocate(d, g, Placement(1), 0, PAGES)
    w = OwnedRowWrite(ChunkStaging(pool, PAGE), pool)
    slots = np.arange(PAGE, 2 * PAGE, dtype=np.int64)
    with pytest.raises(kvshard.error.InvalidArgumentError, match="1-D"):
        w.run(slots.reshape(2, PAGE // 2))
    with pytest.raises(kvshard.error.InvalidArgumentError, match="int64"):
        w.run(slots.astype(np.float64))
    with pytest.raises(kvshard.error.InvalidArgumentError, match=r"value 1 is 65\.5: expected an integer"):
        w.run([64, 65.5])
    with pytest.raises(kvshard.error.InvalidArgumentError, match=r"value 0 is 64\.0"):
        w.run([64.0])
    w.run([np.int64(s) for s in slots])  # NumPy integers are integers
    w.run(list(slots))
    d.synchronize()
    unsharded = Placement(1)
    whole = list(range(PAGE, 2 * PAGE))
    with pytest.raises(kvshard.error.InvalidArgumentError, match="expected an integer"):
        TransferPlan.from_slots(unsharded, 0, [float(s) for s in whole], whole, PAGES, PAGES)
    with pytest.raises(kvshard.error.InvalidArgumentError, match="1-D"):
        TransferPlan.from_slots(unsharded, 0, np.array([whole]), whole, PAGES, PAGES)
    assert len(TransferPlan.from_slots(unsharded, 0, np.array(whole), whole, PAGES, PAGES)) == 1


def test_pending_frees_are_counted_and_waited_for_with_a_deadline():
    assert pending_frees() >= 0
    wait_for_frees_sync(5.0)  # nothing on a GPU waits here
    for bad in [-1.0, float("nan"), float("inf"), 1e300]:
        with pytest.raises(kvshard.error.InvalidArgumentError, match="finite, non-negative"):
            wait_for_frees_sync(bad)
    g, d = small(), kvshard.Device.cpu()
    # Registrable memory (what a transfer engine registers by address) is plain memory here.
    pool = DevicePool.allocate(d, g, Placement(1), 0, PAGES, registrable=True)
    assert pool.owned
