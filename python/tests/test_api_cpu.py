"""The Python API on the CPU backend: presets, ownership, budget, errors, tensors both ways
through DLPack, streams and events, host pools in every format, and transfers on every I/O
backend."""

import numpy as np
import pytest

import kvshard
from kvshard.backend import driver_present
from kvshard.copy import Direction, Method
from kvshard.error import HiCacheError, OutOfMemoryError, UnavailableError
from kvshard.geometry import (
    CacheGeometry,
    Component,
    INDEXER_PAGE_BYTES,
    LatentLayout,
    PoolGeometry,
)
from kvshard.hicache import HiCacheController, HostTransfer, LoadHandle, TransferPlan
from kvshard.pool import (
    Budget,
    ChunkStaging,
    DevicePool,
    HostLayout,
    HostPool,
    OwnedRowWrite,
    plan_capacity,
)
from kvshard.shard import Placement, RequestChain, ShardAllocator
from kvshard.transfer import Sender
from conftest import PAGE, engine_tensors, nonzero, wrap

C = Component
H = HostLayout
IO = Method


def test_presets_follow_the_public_configs():
    ds = CacheGeometry.deepseek_v32()
    assert ds.target.num_layers == 61 and ds.target.num_indexer_layers == 61
    assert ds.draft is not None and ds.model_layers == 62
    glm = CacheGeometry.glm5(latent=LatentLayout.FP8_SCALED, mtp=False)
    assert glm.target.num_layers == 78 and glm.draft is None
    assert glm.target.row_bytes == 656
    # 61 x (36,864 + 8,448) bytes per page for the target, the same for one draft layer.
    assert ds.page_bytes == 62 * (36_864 + 8_448)
    assert LatentLayout.FP8_TRTLLM.row_bytes == 576
    assert LatentLayout.BF16.block_bytes == 64 * 1152
    comps = ds.components()
    assert [c.component for c in comps] == [C.TARGET_LATENT, C.TARGET_INDEXER, C.DRAFT_LATENT, C.DRAFT_INDEXER]
    assert comps[2].model_layers == [61]


def test_geometry_refuses_what_kvshard_does_not_support():
    with pytest.raises(kvshard.error.InvalidArgumentError):
        PoolGeometry(LatentLayout.FP8_TRTLLM, 0)
    prefill = CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 4), draft=True)
    decode = CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 4))
    with pytest.raises(kvshard.error.InvalidArgumentError, match="draft pool present"):
        prefill.validate_pd(decode)


def test_placement_allocator_and_chain():
    p = Placement(4)
    assert (p.owner(13), p.local(13), p.logical(1, 3)) == (1, 3, 13)
    assert p.local_row(13 * 64 + 5) == 3 * 64 + 5 and p.is_reserved(3)
    alloc = ShardAllocator(Placement(3), 10)
    chain = RequestChain(Placement(3))
    chain.grow_to(alloc, 300)
    b = chain.start_owner
    assert [pg % 3 for pg in chain.pages] == [(b + i) % 3 for i in range(5)]
    assert chain.slots(62, 66)[1] // 64 == chain.pages[0]
    node = chain.cache_node(7, 1, 3)
    assert node.start_owner == (b + 1) % 3 and node.device_pages == chain.pages[1:3]
    host = ShardAllocator(Placement(3), 10)
    hp = RequestChain.host_pages(node, host)
    assert [x % 3 for x in hp] == [x % 3 for x in node.device_pages]
    a = alloc.alloc(2, start_owner=b, prefix_tokens=320)
    assert a.first_position == 5 and len(a.pages) == 2
    with pytest.raises(kvshard.error.InvalidArgumentError, match="double free"):
        alloc.free(a.pages + a.pages[:1])
    # Running out of an owner class is a MemoryError.
    with pytest.raises(MemoryError):
        alloc.alloc(100)
    assert isinstance(OutOfMemoryError("x"), kvshard.KvshardError)


def test_budget():
    g = CacheGeometry.deepseek_v32()
    b = Budget.plan(80 << 30, 16384, 8192, g, Placement(4))
    assert b.pages > 0 and b.scratch_rows > 0 and b.logical_capacity == 4 * 64 * b.pages
    with pytest.raises(MemoryError):
        Budget.plan(1 << 20, 16384, 8192, g, Placement(4))


# Old behaviour: a 0-token context and a 0-token chunk were planned; now the budget and the
# capacity planner refuse them (and 0 contexts) with InvalidArgumentError, at every shard size.
@pytest.mark.parametrize("cp", [1, 4])
def test_budgets_and_plans_refuse_what_sizes_nothing(cp):
    g = CacheGeometry.deepseek_v32()
    p = Placement(cp)
    for args, kwargs, what in [
        ((80 << 30, 0, 8192), {}, "context length of 0 tokens"),
        ((80 << 30, 16384, 0), {}, "chunk size of 0 tokens"),
        ((80 << 30, 16384, 8192), {"contexts": 0}, "contexts per batch of 0"),
    ]:
        with pytest.raises(kvshard.error.InvalidArgumentError, match=what):
            Budget.plan(*args, g, p, **kwargs)
    for kwargs, what in [
        ({"context_len": 0}, "context length of 0 tokens"),
        ({"chunk_size": 0}, "chunk size of 0 tokens"),
        ({"contexts": 0}, "contexts per batch of 0"),
    ]:
        with pytest.raises(kvshard.error.InvalidArgumentError, match=what):
            plan_capacity(g, cp, 80 << 30, 1 << 40, host_factor=4, **kwargs)


def test_no_gpu_is_an_unavailable_error_not_a_crash():
    if driver_present():
        pytest.skip("a CUDA driver is present")
    with pytest.raises(UnavailableError):
        kvshard.Device.cuda(0)
    assert isinstance(UnavailableError("x"), RuntimeError)


def test_views_of_kvshard_memory_are_zero_copy_both_ways(rng):
    g = CacheGeometry(PoolGeometry(LatentLayout.BF16, 2), draft=True)
    d = kvshard.Device.cpu()
    pool = DevicePool.allocate(d, g, Placement(1), 0, 4)
    assert pool.owned
    v = pool.layer_view(C.TARGET_LATENT, 1)
    assert v.shape == [4 * 64, 576] and v.dtype == "bfloat16"
    # NumPy has no bfloat16; it says so with RuntimeError or (NumPy >= 2.1) BufferError.
    with pytest.raises((RuntimeError, BufferError)):
        np.from_dlpack(v)
    raw = np.from_dlpack(pool.layer_view(C.TARGET_LATENT, 1, raw=True))
    assert raw.shape == (4 * 64, 1152)
    arr = raw
    raw[...] = nonzero(rng, raw.shape)
    assert pool.read_block_sync(C.TARGET_LATENT, 1, 2) == raw[128:192].tobytes()
    ix = np.from_dlpack(pool.layer_view(C.TARGET_INDEXER, 0))
    assert ix.shape == (4, INDEXER_PAGE_BYTES) and ix.dtype == np.uint8
    ix[3] = 7
    assert pool.read_block_sync(C.TARGET_INDEXER, 0, 3) == bytes([7]) * INDEXER_PAGE_BYTES
    # The view keeps the pool's memory alive after the pool object is gone.
    del pool
    arr[0, 0] = 1


def test_wrap_checks_every_tensor_against_the_geometry():
    g = CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 2))
    d = kvshard.Device.cpu()
    p = Placement(1)
    ok = engine_tensors(g, 8)
    # One stacked tensor per component works as well as a list.
    stacked = np.zeros((2, 8 * PAGE, 576), np.uint8)
    pool = DevicePool.wrap(d, g, p, 0, 8, stacked, ok[C.TARGET_INDEXER])
    stacked[1, 64:128] = 9
    assert pool.read_block_sync(C.TARGET_LATENT, 1, 1) == bytes([9]) * 36864
    bad = [
        ([np.zeros((8 * PAGE, 1, 576), np.float32)] * 2, "dtype"),
        ([np.zeros((4 * PAGE, 1, 576), np.uint8)] * 2, "holds"),
        ([np.zeros((8 * PAGE, 576, 2), np.uint8)[:, :, 0]] * 2, "C-contiguous"),
        ([np.zeros((8 * PAGE, 1, 656), np.uint8)] * 2, "576-byte row"),
        ([np.zeros((8 * PAGE, 1, 576), np.uint8)] * 3, "expected 2 tensors"),
    ]
    for tensors, why in bad:
        with pytest.raises(ValueError, match=why) as e:
            DevicePool.wrap(d, g, p, 0, 8, tensors, ok[C.TARGET_INDEXER])
        assert isinstance(e.value, kvshard.KvshardError)
    with pytest.raises(ValueError, match="no draft latent"):
        DevicePool.wrap(d, g, p, 0, 8, ok[C.TARGET_LATENT], ok[C.TARGET_INDEXER], ok[C.TARGET_LATENT])


def test_streams_and_events():
    d = kvshard.Device.cpu(order="deferred")
    a, b = d.new_stream(), d.new_stream()
    g = CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 1))
    pool = DevicePool.allocate(d, g, Placement(1), 0, 2)
    pool.fill(5, a)
    e = a.record()
    assert not e.query()  # deferred: nothing ran yet
    b.wait(e)
    b.synchronize()  # running b runs a up to the event
    assert e.query()
    assert pool.read_block_sync(C.TARGET_LATENT, 0, 1, a) == bytes([5]) * 36864
    with pytest.raises(ValueError, match="stream"):
        pool.fill(1, "not a stream")
    with pytest.raises(ValueError):
        pool.fill(1, kvshard.Device.cpu().new_stream())  # another device's stream


@pytest.mark.parametrize("layout", [H.LAYER_FIRST, H.PAGE_FIRST, H.PAGE_FIRST_DIRECT], ids=str)
@pytest.mark.parametrize("packed", [False, True])
def test_host_buffer_views_have_sglangs_shapes_and_kvshards_offsets(layout, packed):
    g = CacheGeometry(
        PoolGeometry(LatentLayout.FP8_SCALED, indexer_layers=[True, False, True]), draft=True
    )
    d = kvshard.Device.cpu()
    pages = 5
    host = HostPool(d, g, pages, layout, sglang=True, packed_draft=packed)
    layouts = host.buffer_layouts()
    assert len(layouts) == (2 if packed else 4)
    L = 4 if packed else 3
    kv = np.from_dlpack(host.buffer_view(0))
    want = {
        H.LAYER_FIRST: (L, pages * 64, 1, 656),
        H.PAGE_FIRST: (pages * 64, L, 1, 656),
        H.PAGE_FIRST_DIRECT: (pages, L, 64, 1, 656),
    }[layout]
    assert kv.shape == want
    ix = np.from_dlpack(host.buffer_view(1))
    Li = 3 if packed else 2
    assert ix.shape == ((Li, pages + 1, 8448) if layout == H.LAYER_FIRST else (pages + 1, Li, 1, 8448))
    # kvshard's row offsets are the NumPy views' element offsets.
    for comp, layer, page, row in [(C.TARGET_LATENT, 2, 3, 17), (C.DRAFT_LATENT, 0, 4, 63)]:
        buf, first = host.component_buffer(comp)
        view = np.from_dlpack(host.buffer_view(buf))
        hl = first + layer
        idx = {
            H.LAYER_FIRST: (hl, page * 64 + row, 0, 0),
            H.PAGE_FIRST: (page * 64 + row, hl, 0, 0),
            H.PAGE_FIRST_DIRECT: (page, hl, row, 0, 0),
        }[layout]
        assert host.row_offset(comp, layer, page, row) == int(np.ravel_multi_index(idx, view.shape))
    assert host.bytes == sum(b.bytes for b in layouts)
    assert host.host_ptr(0) == kv.ctypes.data


@pytest.mark.parametrize("io", [IO.KERNEL, IO.COPY_ENGINE, IO.PER_BLOCK, IO.BATCHED_COPY_ENGINE], ids=repr)
def test_host_transfer_on_every_io_backend(rng, io):
    g = CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, indexer_layers=[True, False]), draft=True)
    d = kvshard.Device.cpu()
    placement = Placement(2)
    tensors = engine_tensors(g, 8)
    for arrays in tensors.values():
        for a in arrays:
            a[...] = nonzero(rng, a.shape)
    pool = wrap(d, g, placement, 1, 8, tensors)
    host = HostPool(d, g, 6, H.PAGE_FIRST, sglang=True, packed_draft=True)
    plan = TransferPlan(placement, 1, [3, 5, 4, 7], [3, 5, 8, 9], 8, 6)
    assert len(plan) == 3 and plan.requested == 4 and plan.positions == [0, 1, 3]
    backup = HostTransfer(pool, host, plan, Direction.BACKUP)
    backup.prepare_kernel_sync()
    backup.run(None, io)
    assert backup.bytes() == 3 * g.page_bytes
    assert backup.calls(io)["launches"] == (1 if io == IO.KERNEL else 0)
    d.synchronize()
    kv = np.from_dlpack(host.buffer_view(0))  # [pages*64, L+1, 1, 576]
    for dev_local, host_local in zip(plan.device_pages, plan.host_pages):
        for layer in range(2):
            assert np.array_equal(
                kv[host_local * 64 : host_local * 64 + 64, layer, 0],
                tensors[C.TARGET_LATENT][layer][dev_local * 64 : dev_local * 64 + 64, 0],
            )
        assert np.array_equal(
            kv[host_local * 64 : host_local * 64 + 64, 2, 0],
            tensors[C.DRAFT_LATENT][0][dev_local * 64 : dev_local * 64 + 64, 0],
        )
    # The same plan from SGLang-style per-token slots.
    s = lambda pages: np.asarray([p * 64 + t for p in pages for t in range(64)], np.int64)
    again = TransferPlan.from_slots(placement, 1, s([3, 5, 4, 7]), s([3, 5, 8, 9]), 8, 6)
    assert again.runs == plan.runs
    with pytest.raises(HiCacheError, match="whole, aligned page"):
        TransferPlan.from_slots(placement, 1, s([3])[1:].tolist() + [0], s([3]), 8, 6)


# Old behaviour: the native timing loops reserved room for any count of iterations up front (a
# capacity overflow panic, or an allocation abort), and request ids wrapped past 2^64.
def test_the_native_timing_loops_bound_their_iterations():
    g = CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 2))
    d = kvshard.Device.cpu()
    placement = Placement(1)
    pool = DevicePool.allocate(d, g, placement, 0, 8)
    host = HostPool(d, g, 8, H.PAGE_FIRST)
    plan = TransferPlan(placement, 0, [1, 2], [1, 2], 8, 8)
    t = HostTransfer(pool, host, plan, Direction.BACKUP)
    t.prepare_kernel_sync()
    for iters in [(1 << 24) + 1, (1 << 63) - 1]:
        with pytest.raises(kvshard.error.InvalidArgumentError, match="iterations: at most"):
            kvshard._kvshard._rust_bulk_seconds(t, None, IO.KERNEL, iters)
    assert kvshard._kvshard._rust_bulk_seconds(t, None, IO.KERNEL, 2) >= 0.0


def test_owned_row_write_checked_refuses_bad_slots():
    g = CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 2))
    d = kvshard.Device.cpu()
    pool = DevicePool.allocate(d, g, Placement(2), 0, 4)
    staging = ChunkStaging(pool, 128)
    w = OwnedRowWrite(staging, pool)
    assert w.launch(128)[1] > 0 and w.row_bytes == 2 * (576 + 132)
    with pytest.raises(kvshard.error.InvalidArgumentError, match="reserved"):
        w.run_checked_sync([5])  # logical page 0 is padding
    with pytest.raises(ValueError):
        w.run(np.zeros(200, np.int64))  # more slots than the staging holds
    staging.write(C.TARGET_LATENT, 0, bytes([3]) * 576)
    w.run_checked_sync(list(range(2 * 64 * 2, 2 * 64 * 2 + 1)))  # logical page 4: rank 0's page 2
    assert pool.read_block_sync(C.TARGET_LATENT, 0, 2)[:576] == bytes([3]) * 576


def test_help_reads_well():
    for cls in [HostPool, DevicePool, HiCacheController, Sender]:
        assert cls.__doc__ and len(cls.__doc__) > 80
    assert "wait_layer" in dir(LoadHandle)
    assert LoadHandle.wait_layer.__doc__.startswith("Makes later work")
