"""GPU tests with the machine's own PyTorch: torch tensors as the engine's pools, torch streams,
round trips byte-identical to torch-computed references, layer waits on a torch stream, the
SGLang-shaped host pool on memory registered with cudaHostRegister (as SGLang registers it),
no hidden synchronization, `stream=None` as torch's current stream, `after=` waits on torch
events and streams, and frees that never wait for a torch stream (each drop timed with torch
matmuls queued: the `free timing:` lines) and give the memory back. Skipped (saying why) without torch, a GPU, or kernels in the
build; KVSHARD_REQUIRE_GPU=1 turns the skip into a failure."""

import os
import time

import numpy as np
import pytest

import kvshard
from kvshard.backend import embedded_archs, wait_for_frees_sync
from kvshard.copy import Direction, Method, RemoteSpace
from kvshard.geometry import (
    CacheGeometry,
    Component,
    INDEXER_PAGE_BYTES,
    LatentLayout,
    PAGE_SIZE,
    PoolGeometry,
)
from kvshard.hicache import CacheNode, Route, TransferPlan
from kvshard.pool import HostLayout, PoolLayout
from kvshard.shard import Placement, RequestChain, ShardAllocator
from kvshard.transfer import Receiver, Sender

torch = pytest.importorskip("torch") if os.environ.get("KVSHARD_REQUIRE_GPU") != "1" else __import__("torch")


def _why_not():
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    if embedded_archs() is None:
        return "this kvshard build embeds no kernels (built without nvcc)"
    return None


_reason = _why_not()
if _reason and os.environ.get("KVSHARD_REQUIRE_GPU") == "1":
    raise RuntimeError(f"KVSHARD_REQUIRE_GPU=1 but {_reason}")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_reason is not None, reason=_reason or "")]

PAGE = PAGE_SIZE
C = Component


@pytest.fixture(scope="module")
def device():
    return kvshard.Device.cuda(0)


def geometry():
    return CacheGeometry(
        PoolGeometry(LatentLayout.FP8_TRTLLM, indexer_layers=[True, True, False, True]), draft=True
    )


def torch_tensors(g, pages, random=False, gen=None):
    """The engine's per-layer KV tensors on the GPU, SGLang's shapes (uint8)."""
    out = {}
    for c in g.components():
        shape = (pages * PAGE, 1, c.row_bytes) if c.rows > 1 else (pages, c.row_bytes)
        layers = []
        for _ in range(c.layers):
            if random:
                t = torch.randint(1, 256, shape, dtype=torch.uint8, device="cuda", generator=gen)
            else:
                t = torch.zeros(shape, dtype=torch.uint8, device="cuda")
            layers.append(t)
        out[c.component] = layers
    return out


def wrap(device, g, placement, rank, pages, t):
    return kvshard.pool.DevicePool.wrap(
        device, g, placement, rank, pages,
        t[C.TARGET_LATENT], t.get(C.TARGET_INDEXER), t.get(C.DRAFT_LATENT), t.get(C.DRAFT_INDEXER),
    )


def page_of(t, component, layer, page):
    x = t[component][layer]
    return x[page * PAGE : (page + 1) * PAGE] if x.dim() == 3 else x[page]


@pytest.fixture
def gen():
    g = torch.Generator(device="cuda")
    g.manual_seed(1234)
    return g


def test_torch_tensors_as_pools_chunked_owned_row_writes_on_a_torch_stream(device, gen):
    g, ranks, pages, prompt, chunk = geometry(), 2, 32, 1500, 512
    placement = Placement(ranks)
    tensors = [torch_tensors(g, pages) for _ in range(ranks)]
    pools = [wrap(device, g, placement, r, pages, tensors[r]) for r in range(ranks)]
    alloc = ShardAllocator(placement, pages)
    chain = RequestChain(placement)
    staging = kvshard.pool.ChunkStaging(pools[0], chunk)
    writers = [kvshard.pool.OwnedRowWrite(staging, p) for p in pools]
    stream = torch.cuda.Stream()
    ref = {c.component: [torch.randint(1, 256, (prompt, c.row_bytes) if c.rows > 1 else (-(-prompt // PAGE), c.row_bytes), dtype=torch.uint8, device="cuda", generator=gen) for _ in range(c.layers)] for c in g.components()}
    torch.cuda.synchronize()  # the pools and references were made on the default stream
    start = 0
    with torch.cuda.stream(stream):
        while start < prompt:
            end = min(start + chunk, prompt)
            chain.grow_to(alloc, end)
            for c in g.components():
                for layer in range(c.layers):
                    view = torch.from_dlpack(staging.layer_view(c.component, layer))
                    if c.rows > 1:
                        view[: end - start].copy_(ref[c.component][layer][start:end])
                    else:
                        n = -(-(end - start) // PAGE)
                        view[:n].copy_(ref[c.component][layer][start // PAGE : start // PAGE + n])
            slots = torch.tensor(chain.slots(start, end), dtype=torch.int64, device="cuda")
            for w in writers:
                w.run(slots, stream)  # the torch stream, enqueued in order with the copies
            start = end
    stream.synchronize()
    device.synchronize()  # surfaces any slot a kernel rejected
    # Torch-computed reference: each rank's latent rows at its local rows.
    for c in g.components():
        if c.rows == 1:
            continue
        for layer in range(c.layers):
            for r in range(ranks):
                slots = torch.tensor(chain.slots(0, prompt), device="cuda")
                pages_of = slots // PAGE
                mine = (pages_of % ranks) == r
                local_rows = (slots // (PAGE * ranks)) * PAGE + slots % PAGE
                got = tensors[r][c.component][layer][:, 0][local_rows[mine]]
                assert torch.equal(got, ref[c.component][layer][mine]), (c.component, layer, r)


def test_pd_round_trip_with_torch_decode_pool(device, gen):
    g, ranks, pages = geometry(), 2, 24
    placement = Placement(ranks)
    tensors = [torch_tensors(g, pages, True, gen) for _ in range(ranks)]
    pools = [wrap(device, g, placement, r, pages, tensors[r]) for r in range(ranks)]
    alloc = ShardAllocator(placement, pages)
    chain = RequestChain(placement)
    chain.grow_to(alloc, 1000)
    unsharded = Placement(1)
    dec = torch_tensors(g, pages)
    decode = wrap(device, g, unsharded, 0, pages, dec)
    dchain = RequestChain(unsharded)
    dchain.grow_to(ShardAllocator(unsharded, pages), 1000)
    reg = dchain.registration(1, PoolLayout.of(decode))
    dst = RemoteSpace.of(decode)
    rx = Receiver()
    rx.register(reg, ranks)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()  # the tensors were filled on the default stream
    done = None
    for method in [Method.KERNEL]:
        senders = [Sender(p, stream, method) for p in pools]
        for i, end in enumerate([512, 1000]):
            for s in senders:
                if i == 0:
                    s.open(reg, dst)
                done = rx.receive(s.send(1, chain.pages, end, last=i == 1).wait_sync()) or done
    assert done is not None and done.completed
    for i, page in enumerate(chain.pages):
        owner, local = page % ranks, page // ranks
        for c in g.components():
            for layer in range(c.layers):
                assert torch.equal(
                    page_of(dec, c.component, layer, dchain.pages[i]),
                    page_of(tensors[owner], c.component, layer, local),
                )


@pytest.mark.parametrize("route", [Route.KERNEL, Route.COPY_ENGINE, Route.STAGED, Route.STAGED_KERNEL], ids=repr)
@pytest.mark.parametrize("packed", [False, True])
def test_hicache_round_trip_and_layer_waits_on_a_torch_stream(device, gen, route, packed):
    g, pages = geometry(), 40
    placement = Placement(2)
    t = torch_tensors(g, pages, True, gen)
    pool = wrap(device, g, placement, 1, pages, t)
    staged = route in (Route.STAGED, Route.STAGED_KERNEL)
    layout = HostLayout.LAYER_FIRST if packed and staged else HostLayout.PAGE_FIRST
    host = kvshard.pool.HostPool(device, g, pages, layout, sglang=True, packed_draft=packed)
    ctl = kvshard.hicache.HiCacheController(pool, host)
    chain_pages = [p for p in range(2, 2 * pages) if p % 2 == 1][:24]
    # Rank 1's pages only (no shard owner: host pages of the same owner class).
    node = CacheNode(5, chain_pages, None)
    compute = torch.cuda.current_stream()
    want = {p: [page_of(t, c.component, l, p // 2).clone() for c in g.components() for l in range(c.layers)] for p in chain_pages}
    assert ctl.access(node, compute, route) == 0
    ctl.ack_backups_sync(1)
    for arrays in t.values():
        for x in arrays:
            x.zero_()
    torch.cuda.synchronize()
    consumer = torch.cuda.Stream()
    handle = ctl.load(5, chain_pages, None, route)
    outs = []
    with torch.cuda.stream(consumer):
        for m in range(g.model_layers):
            handle.wait_layer(consumer, m)
            # The consumer reads layer m right after its wait, on its own stream.
            if m < g.target.num_layers:
                outs.append((m, t[C.TARGET_LATENT][m][: pages * PAGE].clone()))
    consumer.synchronize()
    ctl.ack_loads_sync(1)
    for m, snap in outs:
        for p in chain_pages:
            assert torch.equal(snap[(p // 2) * PAGE : (p // 2 + 1) * PAGE], want[p][m]), (route, m, p)
    for p in chain_pages:
        got = [page_of(t, c.component, l, p // 2) for c in g.components() for l in range(c.layers)]
        assert all(torch.equal(a, b) for a, b in zip(got, want[p]))


def test_enqueueing_never_synchronizes_the_callers_stream(device, gen):
    g, pages = geometry(), 16
    placement = Placement(1)
    t = torch_tensors(g, pages, True, gen)
    pool = wrap(device, g, placement, 0, pages, t)
    host = kvshard.pool.HostPool(device, g, pages, HostLayout.PAGE_FIRST_DIRECT)
    plan = TransferPlan(placement, 0, list(range(1, 9)), list(range(1, 9)), pages, pages)
    tr = kvshard.hicache.HostTransfer(pool, host, plan, Direction.BACKUP)
    tr.prepare_kernel_sync()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    ks = device.stream(s)  # the one-time wrap, before the stream is busy
    with torch.cuda.stream(s):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued ahead
    t0 = time.perf_counter()
    for io in [Method.KERNEL, Method.COPY_ENGINE]:
        tr.run(s, io)
    e = ks.record()
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.2, f"enqueueing took {elapsed:.3f} s: something waited for the stream"
    assert not e.query(), "the copies ran before the sleep ahead of them on the stream"
    e.synchronize()
    assert e.query()


def test_stream_none_is_torchs_current_stream(device):
    """With torch in use, a call given no stream enqueues on torch's current stream: a fill
    issued inside `torch.cuda.stream(s)` lands after the sleep and the torch write queued on s
    before it (on the legacy default stream it would run at once, under torch's write)."""
    g, pages = geometry(), 8
    t = torch_tensors(g, pages)
    pool = wrap(device, g, Placement(1), 0, pages, t)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    device.stream(s)  # the one-time wrap, before the stream is busy
    x = t[C.TARGET_LATENT][0]
    with torch.cuda.stream(s):
        torch.cuda._sleep(500_000_000)
        x.fill_(1)
        pool.fill(5)
    s.synchronize()
    assert bool((x == 5).all())


class _ProtocolStream:
    """A stream exposing only the CUDA stream protocol (`__cuda_stream__() -> (0, handle)`),
    here over a torch stream's handle."""

    def __init__(self, handle):
        self._handle = handle

    def __cuda_stream__(self):
        return (0, self._handle)


@pytest.mark.parametrize("shape", ["torch_stream", "cuda_stream_protocol", "int_handle", "torch_current_stream"])
def test_repeated_calls_on_a_foreign_stream_stay_ordered_on_it(device, shape):
    """A foreign stream is wrapped once and reused (its handle is the key): call after call on
    the same torch stream, each fill lands after the torch write queued before it on that
    stream, never on another stream (the sleep ahead would let it run early)."""
    g, pages = geometry(), 8
    t = torch_tensors(g, pages)
    pool = wrap(device, g, Placement(1), 0, pages, t)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    arg = {
        "torch_stream": s,
        "cuda_stream_protocol": _ProtocolStream(s.cuda_stream),
        "int_handle": s.cuda_stream,
        "torch_current_stream": None,
    }[shape]
    assert kvshard._kvshard._stream_handle(s) == s.cuda_stream
    x = t[C.TARGET_LATENT][0]
    with torch.cuda.stream(s):
        for value in range(1, 6):
            torch.cuda._sleep(50_000_000)
            x.fill_(100 + value)
            pool.fill(value, arg)
            s.synchronize()
            assert bool((x == value).all()), (shape, value)


@pytest.mark.parametrize("after", ["torch_event", "torch_stream", "torch_current_stream"])
def test_after_waits_for_torch_events_and_streams(device, after):
    """A backup after a torch event, a torch stream, or None (torch's current stream) copies
    what the work queued before it wrote, not what was there (the work is behind a sleep)."""
    g, pages = geometry(), 16
    t = torch_tensors(g, pages)
    pool = wrap(device, g, Placement(1), 0, pages, t)
    host = kvshard.pool.HostPool(device, g, pages, HostLayout.PAGE_FIRST)
    ctl = kvshard.hicache.HiCacheController(pool, host)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    for i in range(2):
        node = CacheNode(i + 1, [2 + 2 * i, 3 + 2 * i])
        with torch.cuda.stream(s):
            torch.cuda._sleep(500_000_000)
            for arrays in t.values():
                for x in arrays:
                    x.fill_(7 + i)  # the forward pass writing the node's pages
            e = torch.cuda.Event()
            e.record(s)
            if after == "torch_current_stream":
                ctl.backup(node, None)
        if after != "torch_current_stream":
            ctl.backup(node, e if after == "torch_event" else s)
        (ack,) = ctl.ack_backups_sync(1)
        kv = torch.from_dlpack(host.buffer_view(0))  # [pages * 64, L, 1, row]: the target latent
        for hp in ack.host_pages:
            assert bool((kv[hp * PAGE : (hp + 1) * PAGE] == 7 + i).all()), (after, i, hp)
    # An event never recorded is nothing to wait for.
    assert ctl.backup(CacheNode(9, [8]), torch.cuda.Event()) == 2
    ctl.ack_backups_sync(1)


def test_sglang_host_pool_on_memory_registered_with_cuda_host_register(device, gen):
    from kvshard.sglang import MLAHostPool

    g, page_num, pages = geometry(), 12, 16
    placement = Placement(1)
    t = torch_tensors(g, pages, True, gen)
    pool = wrap(device, g, placement, 0, pages, t)
    torch.cuda.synchronize()
    L, Li = g.target.num_layers + 1, g.target.num_indexer_layers + 1
    kv = torch.zeros((page_num * PAGE, L, 1, 576), dtype=torch.uint8)
    ix = torch.zeros((page_num + 1, Li, 1, INDEXER_PAGE_BYTES), dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    registered = []
    # SGLang registers in chunks of whole pages of every layer; two chunks for the latent.
    for buf, unit in [(kv, PAGE * L * 576), (ix, None)]:
        base, total = buf.data_ptr(), buf.numel()
        step = unit * (page_num // 2) if unit else total
        ranges, off = [], 0
        while off < total:
            size = min(step, total - off)
            assert int(cudart.cudaHostRegister(base + off, size, 0)) == 0
            ranges.append((base + off, size))
            off += size
        buf._sglang_cuda_host_registered_ranges = ranges
        registered += ranges
    try:
        host = MLAHostPool(device, g, page_num, "page_first", "kernel", buffers=[kv, ix])
        dev_pages, host_pages = [2, 9, 3, 14], [1, 6, 7, 11]
        didx = torch.tensor([p * PAGE + i for p in dev_pages for i in range(PAGE)], dtype=torch.int64)
        hidx = torch.tensor([p * PAGE + i for p in host_pages for i in range(PAGE)], dtype=torch.int64)
        for io in ["kernel", "direct"]:
            kv.zero_()
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                h, d = host.prepare_transfer_indices(hidx, didx, io)
                host.backup_from_device_all_layer_physical(pool, h, d, io)
            s.synchronize()
            # Torch-computed reference: SGLang's page_first indexing [token, layer, 0, :].
            for dp, hp in zip(dev_pages, host_pages):
                for layer in range(g.target.num_layers):
                    assert torch.equal(
                        kv[hp * PAGE : (hp + 1) * PAGE, layer, 0],
                        t[C.TARGET_LATENT][layer][dp * PAGE : (dp + 1) * PAGE, 0].cpu(),
                    )
                assert torch.equal(
                    kv[hp * PAGE : (hp + 1) * PAGE, L - 1, 0],
                    t[C.DRAFT_LATENT][0][dp * PAGE : (dp + 1) * PAGE, 0].cpu(),
                )
                assert torch.equal(ix[hp, Li - 1, 0], t[C.DRAFT_INDEXER][0][dp].cpu())
            # Storage-backend access: host pointers into the engine's own tensors.
            ptrs, sizes = host.get_page_buffer_meta(hidx[:PAGE])
            assert ptrs == [kv.data_ptr() + host_pages[0] * L * 576 * PAGE]
            page = host.get_data_page(host_pages[1] * PAGE)
            assert torch.equal(page, kv[host_pages[1] * PAGE : (host_pages[1] + 1) * PAGE].flatten())
            # Reload layer by layer on a torch stream, SGLang's loop with on_layer_done.
            before = {k: [x.clone() for x in v] for k, v in t.items()}
            for v in t.values():
                for x in v:
                    x.zero_()
            torch.cuda.synchronize()
            events = []
            with torch.cuda.stream(s):
                host.load_all_layers(pool, hidx, didx, io, on_layer_done=lambda i: events.append(torch.cuda.Event()) or events[-1].record())
            s.synchronize()
            assert len(events) == g.target.num_layers
            for k in t:
                for a, b in zip(t[k], before[k]):
                    for dp in dev_pages:
                        sl = slice(dp * PAGE, (dp + 1) * PAGE) if a.dim() == 3 else slice(dp, dp + 1)
                        assert torch.equal(a[sl], b[sl]), k
        del host, page
        import gc

        gc.collect()
        torch.cuda.synchronize()
    finally:
        for base, _ in registered:
            cudart.cudaHostUnregister(base)


def test_dlpack_from_cupy_when_present(device):
    cupy = pytest.importorskip("cupy")
    g = CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 2))
    pages = 8
    lat = [cupy.zeros((pages * PAGE, 576), dtype=cupy.uint8) for _ in range(2)]
    ix = [cupy.zeros((pages, INDEXER_PAGE_BYTES), dtype=cupy.uint8) for _ in range(2)]
    pool = kvshard.pool.DevicePool.wrap(device, g, Placement(1), 0, pages, lat, ix)
    pool.fill(7)
    device.synchronize()
    assert int(lat[1][3 * PAGE, 5]) == 7
    with pytest.raises(ValueError, match="cuda:0"):
        kvshard.pool.DevicePool.wrap(device, g, Placement(1), 0, pages, [x.get() for x in lat], ix)


def _queue_matmuls(stream, ms):
    """About `ms` milliseconds of torch matmuls (8192^2 fp16, the forward pass's kind of work)
    queued on `stream`, counted from a timed run of a few, and the event after them."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn_like(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        torch.mm(a, b)
        start.record()
        for _ in range(4):
            torch.mm(a, b)
        end.record()
    end.synchronize()
    each = max(start.elapsed_time(end) / 4, 1e-3)
    n = max(1, int(ms / each) + 1)
    done = torch.cuda.Event()
    with torch.cuda.stream(stream):
        for _ in range(n):
            torch.mm(a, b)
        done.record()
    return done, n, each


def _aligned_host(nbytes, rows):
    """A zeroed host array of `nbytes` bytes starting on a 4 KiB boundary (what registration
    takes), `rows` bytes a row."""
    raw = np.zeros(nbytes + 4096, np.uint8)
    start = (-raw.ctypes.data) % 4096
    return raw[start : start + nbytes].reshape(nbytes // rows, rows)


# Old behaviour (measured on the H200 at aba463b): with 40 torch matmuls queued on a torch
# stream, dropping an allocated DevicePool, a HostPool or a ChunkStaging blocked 55-61 ms, until
# that stream had finished (cuMemFree / cuMemFreeHost on the dropping thread). Now device memory
# comes from kvshard's stream-ordered pool and every other free runs on its reaper thread: each
# drop returns in under a millisecond while the torch work is still queued, and the memory comes
# back once it may (wait_for_frees_sync).
def test_dropping_kvshard_objects_never_waits_for_a_torch_stream(device, capsys):
    import gc

    g, pages = geometry(), 64
    unsharded = Placement(1)
    pool = kvshard.pool.DevicePool.allocate(device, g, unsharded, 0, pages)
    registrable = kvshard.pool.DevicePool.allocate(device, g, unsharded, 0, pages, registrable=True)
    host = kvshard.pool.HostPool(device, g, pages, HostLayout.PAGE_FIRST)
    layouts = host.buffer_layouts()
    lent = [_aligned_host(b.bytes, b.row_bytes) for b in layouts]
    registered = kvshard.pool.HostPool.wrap(device, g, pages, lent, HostLayout.PAGE_FIRST, register=True)
    staging = kvshard.pool.ChunkStaging(pool, 512)
    writer = kvshard.pool.OwnedRowWrite(staging, pool)
    ctl = kvshard.hicache.HiCacheController(pool, kvshard.pool.HostPool(device, g, pages, HostLayout.PAGE_FIRST))
    signals = kvshard.hicache.LayerSignals(device, g.model_layers)
    plan = TransferPlan(unsharded, 0, list(range(1, 9)), list(range(1, 9)), pages, pages)
    transfer = kvshard.hicache.HostTransfer(pool, host, plan, Direction.BACKUP)
    transfer.prepare_kernel_sync()
    for p in (pool, registrable, host, registered):
        p.fill(3)
    writer.run_checked_sync(list(range(PAGE, 2 * PAGE)))
    transfer.run(None, Method.KERNEL)
    device.synchronize()
    torch.cuda.synchronize()
    # Users first, so each drop below lets go of what it alone holds.
    objects = [
        ("HiCacheController", ctl),
        ("HostTransfer (prepared tables)", transfer),
        ("OwnedRowWrite", writer),
        ("ChunkStaging", staging),
        ("LayerSignals", signals),
        ("DevicePool (allocated)", pool),
        ("DevicePool (registrable)", registrable),
        ("HostPool (pinned)", host),
        ("HostPool (engine memory kvshard registered)", registered),
    ]
    del ctl, transfer, writer, staging, signals, pool, registrable, host, registered
    stream = torch.cuda.Stream()
    done, n, each = _queue_matmuls(stream, 60.0)
    assert not done.query(), "the torch work ran before the drops began"
    times = []
    gc.disable()
    try:
        while objects:
            name, obj = objects.pop(0)
            t0 = time.perf_counter()
            del obj
            times.append((name, (time.perf_counter() - t0) * 1e3))
    finally:
        gc.enable()
    queued = not done.query()
    with capsys.disabled():  # the figures go to the log whether the test passes or not
        print()
        for name, ms in times:
            print(f"free timing: drop of {name}: {ms:.3f} ms with {n} matmuls ({n * each:.0f} ms) queued on a torch stream")
        print(f"free timing: the torch work still queued after every drop: {queued}")
    assert queued, f"a drop waited for the torch stream: {times}"
    slow = [(name, ms) for name, ms in times if ms >= 1.0]
    assert not slow, f"drops of 1 ms or more: {slow}"
    stream.synchronize()
    wait_for_frees_sync(60.0)
    del lent


# Memory kvshard allocates and drops in a loop comes back to the device: 40 pools of a
# sixteenth of the GPU each (2.5 times its memory: memory that never came back would run it
# out), each dropped while a fill of it is queued, then pinned host pools the same way; once
# the frees drain, the device's free memory is where it was.
def test_kvshard_memory_dropped_in_a_loop_comes_back(device):
    g = geometry()
    unsharded = Placement(1)
    torch.cuda.synchronize()
    wait_for_frees_sync(60.0)
    free_before, total = torch.cuda.mem_get_info()
    pages = (total // 16) // g.page_bytes
    for i in range(40):
        pool = kvshard.pool.DevicePool.allocate(device, g, unsharded, 0, pages)
        pool.fill(i)
        del pool
    for i in range(16):
        host = kvshard.pool.HostPool(device, g, 256, HostLayout.PAGE_FIRST)
        host.fill(i)
        del host
    device.synchronize()
    wait_for_frees_sync(60.0)
    free_after, _ = torch.cuda.mem_get_info()
    assert free_after + (64 << 20) >= free_before, (free_before, free_after)
