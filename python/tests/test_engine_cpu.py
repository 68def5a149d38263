"""The whole engine flow on the CPU backend with NumPy arrays as the engine's tensors (the
Python twin of examples/engine.rs): two CP ranks wrap the engine's KV arrays, a prompt is
written chunk by chunk through the owned-row write, sent P/D (every rank sends every chunk,
the empty final one too), backed up by write-through, evicted and reloaded layer by layer
into new pages; every hand-off is checked byte for byte against NumPy."""

import numpy as np
import pytest

import kvshard
from kvshard.copy import Direction, RemoteSpace
from kvshard.error import ChunkFailedError, HiCacheError, TransferError
from kvshard.geometry import CacheGeometry, Component, INDEXER_HEAD_DIM, LatentLayout, PoolGeometry
from kvshard.hicache import (
    CacheNode,
    HiCacheController,
    HostTransfer,
    LayerSignals,
    Route,
    TransferPlan,
    WritePolicy,
)
from kvshard.pool import ChunkStaging, DevicePool, HostLayout, HostPool, OwnedRowWrite, PoolLayout
from kvshard.shard import Placement, RequestChain, ShardAllocator
from kvshard.transfer import Receiver, Registration, Sender
from conftest import PAGE, engine_tensors, nonzero, page_bytes, wrap

RANKS = 2
PAGES = 24
PROMPT = 1000
CHUNK = 256
C = Component


def write_prompt(device, geometry, rng):
    """Two ranks' pools on engine arrays, the prompt written chunk by chunk. Returns the
    ranks' (pool, tensors), the chain and allocator, and the NumPy reference of every
    position's token rows (component, layer) -> [PROMPT, row] / [pages, 8448]."""
    placement = Placement(RANKS)
    ranks = []
    for r in range(RANKS):
        tensors = engine_tensors(geometry, PAGES)
        ranks.append((wrap(device, geometry, placement, r, PAGES, tensors), tensors))
    alloc = ShardAllocator(placement, PAGES)
    chain = RequestChain(placement)
    staging = ChunkStaging(ranks[0][0], CHUNK)
    writers = [OwnedRowWrite(staging, pool) for pool, _ in ranks]
    # What the forward pass computes for every token (latent rows) and every page (indexer).
    ref = {}
    for c in geometry.components():
        rows = PROMPT if c.rows > 1 else -(-PROMPT // PAGE)
        ref[c.component] = [nonzero(rng, (rows, c.row_bytes)) for _ in range(c.layers)]
    start = 0
    while start < PROMPT:
        end = min(start + CHUNK, PROMPT)
        chain.grow_to(alloc, end)
        # The forward pass writes the chunk into the staging, through a zero-copy view.
        for c in geometry.components():
            for layer in range(c.layers):
                view = np.from_dlpack(staging.layer_view(c.component, layer))
                if c.rows > 1:
                    view[: end - start] = ref[c.component][layer][start:end]
                else:
                    view[: -(-(end - start) // PAGE)] = ref[c.component][layer][
                        start // PAGE : -(-end // PAGE)
                    ]
        slots = np.asarray(chain.slots(start, end), dtype=np.int64)
        for w in writers:
            w.run(slots)
        # The next chunk is written into the staging by the host, which kvshard cannot order:
        # wait for this chunk's writes to have read it (a forward pass on the stream would be
        # ordered by the stream itself).
        for pool, _ in ranks:
            pool.device.synchronize()
        start = end
    for pool, _ in ranks:
        pool.device.synchronize()
    return placement, ranks, chain, alloc, ref


def test_the_owned_row_write_persists_each_ranks_rows_into_the_engine_arrays(rng, geometry):
    device = kvshard.Device.cpu()
    placement, ranks, chain, _, ref = write_prompt(device, geometry, rng)
    pages = chain.pages
    for i, page in enumerate(pages):
        owner, local = placement.owner(page), placement.local(page)
        tensors = ranks[owner][1]
        tokens = slice(i * PAGE, min((i + 1) * PAGE, PROMPT))
        n = tokens.stop - tokens.start
        for c in geometry.components():
            for layer in range(c.layers):
                got = tensors[c.component][layer]
                if c.rows > 1:
                    want = ref[c.component][layer][tokens]
                    assert np.array_equal(got[local * PAGE : local * PAGE + n, 0], want)
                # The indexer write persists the owned token rows of each block: keys and
                # scale of token o of the page.
                else:
                    block = ref[c.component][layer][i]
                    keys = INDEXER_HEAD_DIM
                    assert np.array_equal(
                        got[local, : n * keys], block[: n * keys]
                    ), f"{c.component} layer {layer} page {i} keys"
    # Each rank's arrays hold only its own pages: every other local page stays zero.
    for r in range(RANKS):
        mine = {placement.local(p) for p in pages if placement.owner(p) == r}
        latent = ranks[r][1][C.TARGET_LATENT][0]
        for local in range(PAGES):
            if local not in mine:
                assert not latent[local * PAGE : (local + 1) * PAGE].any(), (r, local)


def test_pd_every_rank_sends_every_chunk_and_decode_equals_the_prefill(rng, geometry):
    device = kvshard.Device.cpu()
    placement, ranks, chain, _, _ = write_prompt(device, geometry, rng)
    unsharded = Placement(1)
    dec_tensors = engine_tensors(geometry, PAGES)
    decode = wrap(device, geometry, unsharded, 0, PAGES, dec_tensors)
    dec_alloc = ShardAllocator(unsharded, PAGES)
    dec_chain = RequestChain(unsharded)
    dec_chain.grow_to(dec_alloc, PROMPT)
    reg = dec_chain.registration(7, PoolLayout.of(decode))
    dst = RemoteSpace.of(decode)
    receiver = Receiver()
    receiver.register(reg, RANKS)
    senders = [Sender(pool) for pool, _ in ranks]
    other = device.new_stream()
    finished = None
    for i, end in enumerate([512, PROMPT]):
        for s in senders:
            if i == 0:
                s.open(reg, dst)
            # The final chunk on another stream than the sender's own.
            status = s.send(7, chain.pages, end, last=(i == 1), stream=other if i else None).wait_sync()
            assert status.ok and status.rank == s.rank
            finished = receiver.receive(status) or finished
    assert finished is not None and finished.completed
    assert finished.request == 7 and finished.total_bytes[C.TARGET_LATENT] > 0
    # Decode page of position i equals the owner's page of position i, byte for byte.
    for i, page in enumerate(chain.pages):
        owner, local = placement.owner(page), placement.local(page)
        want = page_bytes(ranks[owner][1], local)
        got = page_bytes(dec_tensors, dec_chain.pages[i])
        assert got == want, f"position {i}"
    assert receiver.pending_requests == 0


def test_a_failed_chunk_raises_with_the_status_to_deliver(rng, geometry):
    device = kvshard.Device.cpu()
    placement, ranks, chain, _, _ = write_prompt(device, geometry, rng)
    unsharded = Placement(1)
    decode = DevicePool.allocate(device, geometry, unsharded, 0, PAGES)
    reg = Registration(3, PoolLayout.of(decode), [1, 2], [1, 2])
    sender = Sender(ranks[0][0])
    sender.open(reg, RemoteSpace.of(decode))
    # More pages than the registration holds: the chunk cannot be planned.
    with pytest.raises(ChunkFailedError) as err:
        sender.send(3, chain.pages, PROMPT, last=True)
    e = err.value
    assert isinstance(e, TransferError) and e.request == 3 and e.rank == 0
    assert e.status.request == 3 and not e.status.ok and e.status.terminal
    receiver = Receiver()
    receiver.register(reg, 1)
    done = receiver.receive(e.status)
    assert done is not None and not done.completed and done.failures[0][0] == 0


@pytest.mark.parametrize(
    "route", [Route.KERNEL, Route.COPY_ENGINE, Route.BATCH, Route.STAGED, Route.STAGED_KERNEL],
    ids=repr,
)
def test_hicache_write_through_evict_and_reload_layer_by_layer(rng, geometry, route):
    device = kvshard.Device.cpu()
    placement, ranks, chain, alloc, _ = write_prompt(device, geometry, rng)
    controllers = []
    for pool, _ in ranks:
        host = HostPool(device, geometry, PAGES, HostLayout.PAGE_FIRST)
        controllers.append(HiCacheController(pool, host, WritePolicy.WRITE_THROUGH))
    node = chain.cache_node(7, 0, len(chain.pages))
    compute = device.stream()
    before = [
        {p: page_bytes(ranks[r][1], placement.local(p)) for p in chain.pages if placement.owner(p) == r}
        for r in range(RANKS)
    ]
    for c in controllers:
        assert c.access(node, compute, route) == 0
        assert [a.node for a in c.ack_backups_sync(1)] == [7]
        assert c.host_pages(7) is not None
    for c in controllers:
        c.evict_sync(node, compute, route)
    # The chain goes stale once its pages are freed: what the reload mirrors is kept first.
    evicted = chain.pages
    alloc.free(evicted)
    for _, tensors in ranks:
        for arrays in tensors.values():
            for a in arrays:
                a[...] = 0
    reloaded = alloc.alloc_matching(evicted)
    consumer = device.new_stream()
    for c in controllers:
        handle = c.load(7, reloaded, route=route)
        assert len(handle) == geometry.model_layers
        for layer in range(geometry.model_layers):
            handle.wait_layer(consumer, layer)
        assert [a.node for a in c.ack_loads_sync(1)] == [7]
    consumer.synchronize()
    for r in range(RANKS):
        for old, new in zip(evicted, reloaded):
            if placement.owner(old) == r:
                assert page_bytes(ranks[r][1], placement.local(new)) == before[r][old]
    RequestChain.cached(alloc, chain.start_owner, reloaded)


def test_the_staged_route_refuses_a_packed_page_major_host_pool(rng):
    geometry = CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 2), draft=True)
    device = kvshard.Device.cpu()
    pool = DevicePool.allocate(device, geometry, Placement(1), 0, 8)
    host = HostPool(device, geometry, 8, HostLayout.PAGE_FIRST, sglang=True, packed_draft=True)
    c = HiCacheController(pool, host)
    node = CacheNode(1, [2, 3])
    with pytest.raises(HiCacheError, match="staged route"):
        c.backup(node, device.stream(), Route.STAGED)
    # Nothing changed: the direct route backs the node up.
    assert c.backup(node, device.stream(), Route.COPY_ENGINE) == 0
    assert c.ack_backups_sync(1)[0].host_pages == c.host_pages(1)


def test_a_deferred_load_is_consumable_layer_by_layer(rng):
    """On the deferred CPU backend work runs only when waited for: a consumer that waits for
    layer 0 sees layer 0 landed in the engine's arrays and the last layer not yet."""
    geometry = CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 4), draft=True)
    device = kvshard.Device.cpu(order="deferred")
    placement = Placement(1)
    tensors = engine_tensors(geometry, 8)
    pool = wrap(device, geometry, placement, 0, 8, tensors)
    host = HostPool(device, geometry, 8, HostLayout.PAGE_FIRST_DIRECT, sglang=True, packed_draft=True)
    views = [np.from_dlpack(host.buffer_view(i)) for i in range(len(host.buffer_layouts()))]
    for v in views:
        v[...] = nonzero(rng, v.shape)
    plan = TransferPlan(placement, 0, [3, 4], [1, 5], 8, 8)
    load = HostTransfer(pool, host, plan, Direction.LOAD)
    load.prepare_kernel_sync()
    signals = LayerSignals(device, geometry.model_layers)
    load_stream, consumer = device.new_stream(), device.new_stream()
    ready = load.run_signalled(signals, load_stream, ctas=1)
    assert len(ready) == geometry.model_layers
    ready[0].wait(consumer)
    consumer.synchronize()
    latent = tensors[C.TARGET_LATENT]
    lf = np.from_dlpack(host.buffer_view(0))  # [pages, L + 1, 64, 1, row]
    assert np.array_equal(latent[0][3 * PAGE : 4 * PAGE], lf[1, 0])
    # The draft is ready with layer 0 (packed: the tail layer of the latent buffer).
    assert np.array_equal(tensors[C.DRAFT_LATENT][0][3 * PAGE : 4 * PAGE], lf[1, 4])
    assert not latent[3][3 * PAGE : 4 * PAGE].any(), "the last layer landed before its wait"
    ready[3].wait(consumer)
    consumer.synchronize()
    assert np.array_equal(latent[3][4 * PAGE : 5 * PAGE], lf[5, 3])
