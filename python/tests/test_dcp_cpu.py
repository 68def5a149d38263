"""Decode context parallelism from Python on the CPU backend (docs/dcp.md): decode layouts under
vLLM's and SGLang's names for their parameters, registrations checked when made, and a request
sent by two page-sharded prefill ranks into the ranks of a decode server sharded by token, each
decode rank's NumPy arrays then holding exactly its tokens' rows (latent, indexer key and
scale), checked against NumPy placing every token by the layout's definition."""

import numpy as np
import pytest

import kvshard
from kvshard.copy import Method, RemoteSpace
from kvshard.error import ChunkFailedError, InvalidArgumentError, TransferError
from kvshard.geometry import Component, INDEXER_HEAD_DIM
from kvshard.shard import MAX_DECODE_RANKS, Placement, RequestChain, ShardAllocator
from kvshard.transfer import DecodeRank, DecodeRegistration, Receiver, Sender
from conftest import PAGE, engine_tensors, nonzero, wrap

C = Component
KEY = INDEXER_HEAD_DIM
SCALES = PAGE * KEY


def test_the_engines_parameters_by_their_names():
    # vLLM: --decode-context-parallel-size, --cp-kv-cache-interleave-size (the block for P/D).
    v = kvshard.shard.DecodeLayout.vllm(4, 64)
    assert (v.ranks, v.interleave) == (4, 64)
    assert (v.decode_context_parallel_size, v.cp_kv_cache_interleave_size) == (4, 64)
    assert v.page_granular
    assert kvshard.shard.DecodeLayout.vllm(decode_context_parallel_size=2) == kvshard.shard.DecodeLayout(2, 1)
    # SGLang's DSA DCP: --dcp-size, token t on rank t % dcp_size.
    s = kvshard.shard.DecodeLayout.sglang(dcp_size=8)
    assert (s.dcp_size, s.interleave, s.page_granular) == (8, 1, False)
    assert s.place(21) == (5, 2)
    assert kvshard.shard.DecodeLayout.unsharded() == kvshard.shard.DecodeLayout()
    assert len({v, kvshard.shard.DecodeLayout(4, 64), s}) == 2
    assert repr(v) == "DecodeLayout(ranks=4, interleave=64)"
    for bad in [(0, 1), (2, 0), (MAX_DECODE_RANKS + 1, 1)]:
        with pytest.raises(InvalidArgumentError):
            kvshard.shard.DecodeLayout(*bad)


@pytest.mark.parametrize("ranks,interleave", [(1, 1), (2, 1), (3, 1), (2, 64), (3, 16), (4, 100)])
def test_placement_is_the_definition(ranks, interleave):
    layout = kvshard.shard.DecodeLayout(ranks, interleave)
    counts = [0] * ranks
    for t in range(700):
        rank, local = layout.place(t)
        assert rank == (t // interleave) % ranks
        assert local == (t // (interleave * ranks)) * interleave + t % interleave
        assert local == counts[rank], "a rank's tokens are its local tokens 0, 1, 2, ..."
        counts[rank] += 1
        assert layout.token(rank, local) == t
    assert [layout.tokens_on(r, 700) for r in range(ranks)] == counts
    assert [layout.pages_on(r, 700) for r in range(ranks)] == [-(-n // PAGE) for n in counts]
    assert layout.token(ranks, 0) is None


def decode_ranks(geometry, layout, tokens, pool_pages):
    """Every decode rank's part: its share's pages from 1 on."""
    return [
        DecodeRank(geometry, pool_pages, list(range(1, 1 + layout.pages_on(d, tokens))))
        for d in range(layout.ranks)
    ]


def test_registrations_are_checked_when_made(geometry):
    layout = kvshard.shard.DecodeLayout.sglang(3)
    ranks = decode_ranks(geometry, layout, 300, 10)
    reg = DecodeRegistration(5, layout, 300, ranks)
    assert (reg.request, reg.tokens, reg.prefix_pages, reg.layout) == (5, 300, 0, layout)
    assert [r.pages for r in reg.ranks] == [[1, 2]] * 3
    has_indexer = any(c.component in (C.TARGET_INDEXER, C.DRAFT_INDEXER) for c in geometry.components())
    assert ranks[0].state_pages == ([1, 2] if has_indexer else [])
    assert ranks[0].pool_pages == 10
    with pytest.raises(TransferError, match="2 decode ranks registered for a layout of 3"):
        DecodeRegistration(5, layout, 300, ranks[:2])
    with pytest.raises(TransferError, match="takes 2"):
        DecodeRegistration(5, layout, 300, [DecodeRank(geometry, 10, [1])] + ranks[1:])
    with pytest.raises(TransferError, match="padding page"):
        DecodeRegistration(5, layout, 300, [DecodeRank(geometry, 10, [0, 1])] + ranks[1:])
    with pytest.raises(TransferError, match="cached prefix"):
        DecodeRegistration(5, layout, 300, ranks, prefix_pages=5)


def prefill(device, geometry, rng, n, pages_per_rank, tokens):
    """N prefill ranks on random engine arrays and a request chain of `tokens` tokens."""
    placement = Placement(n)
    ranks = []
    for r in range(n):
        tensors = engine_tensors(geometry, pages_per_rank)
        for layers in tensors.values():
            for t in layers:
                t[...] = nonzero(rng, t.shape)
        ranks.append((wrap(device, geometry, placement, r, pages_per_rank, tensors), tensors))
    alloc = ShardAllocator(placement, pages_per_rank)
    chain = RequestChain(placement)
    chain.grow_to(alloc, tokens)
    return placement, ranks, chain


@pytest.mark.parametrize("n,m,interleave", [(2, 2, 1), (2, 3, 1), (2, 2, 64), (1, 4, 16), (2, 1, 1)])
def test_a_request_reaches_every_decode_rank_as_placed(rng, geometry, n, m, interleave):
    device = kvshard.Device.cpu()
    tokens, prefix_pages = 900, 1
    placement, ranks, chain = prefill(device, geometry, rng, n, 24, tokens)
    layout = kvshard.shard.DecodeLayout(m, interleave)
    # Decode ranks: zeroed arrays, the share's pages shuffled, cached prefix rows untouched.
    pool_pages = 2 * max(layout.pages_on(d, tokens) for d in range(m)) + 2
    dec = []
    parts = []
    for d in range(m):
        tensors = engine_tensors(geometry, pool_pages)
        pool = wrap(device, geometry, Placement(1), 0, pool_pages, tensors)
        pages = list(rng.permutation(np.arange(1, pool_pages))[: layout.pages_on(d, tokens)])
        parts.append(DecodeRank.of(pool, [int(p) for p in pages]))
        dec.append((pool, tensors, [int(p) for p in pages]))
    reg = DecodeRegistration(11, layout, tokens, parts, prefix_pages=prefix_pages)
    receivers = []
    for d in range(m):
        r = Receiver()
        r.register_decode(reg, d, n)
        receivers.append(r)
    dsts = [RemoteSpace.of(pool) for pool, _, _ in dec]
    senders = [Sender(pool) for pool, _ in ranks]
    for s in senders:
        s.open_decode(reg, dsts)
    finished = [None] * m
    for i, end in enumerate([400, tokens]):
        last = i == 1
        for s in senders:
            chunk = s.send(11, chain.pages, end, last=last)
            assert chunk.decode_ranks == m
            statuses = chunk.poll_each() or chunk.wait_each_sync()
            assert len(statuses) == m
            for d, status in enumerate(statuses):
                assert status.ok and status.rank == s.rank and status.last == last
                finished[d] = receivers[d].receive(status) or finished[d]
    for d, f in enumerate(finished):
        assert f is not None and f.completed, d
        assert f.registration.pages == dec[d][2]
        assert receivers[d].pending_requests == 0

    # NumPy places every token by the definition and compares its rows.
    for t in range(tokens):
        page = chain.pages[t // PAGE]
        owner, local, o = placement.owner(page), placement.local(page), t % PAGE
        d = (t // interleave) % m
        k = (t // (interleave * m)) * interleave + t % interleave
        dst_page, row = dec[d][2][k // PAGE], k % PAGE
        src, got = ranks[owner][1], dec[d][1]
        for c in geometry.components():
            for layer in range(c.layers):
                s, g = src[c.component][layer], got[c.component][layer]
                if c.rows > 1:
                    # Latent rows: the decode's cached prefix is never sent.
                    landed = g[dst_page * PAGE + row, 0]
                    if t < prefix_pages * PAGE:
                        assert not landed.any(), (t, c.component, layer)
                    else:
                        assert np.array_equal(landed, s[local * PAGE + o, 0]), (t, c.component, layer)
                else:
                    assert np.array_equal(g[dst_page, row * KEY : (row + 1) * KEY], s[local, o * KEY : (o + 1) * KEY])
                    assert np.array_equal(
                        g[dst_page, SCALES + 4 * row : SCALES + 4 * row + 4],
                        s[local, SCALES + 4 * o : SCALES + 4 * o + 4],
                    ), (t, c.component, layer)
    # Nothing else was written: every decode row that no token owns stays zero.
    for d, (_, tensors, pages) in enumerate(dec):
        owned = layout.tokens_on(d, tokens)
        latent = tensors[C.TARGET_LATENT][0]
        unused = [p for p in range(pool_pages) if p not in pages]
        for p in unused:
            assert not latent[p * PAGE : (p + 1) * PAGE].any(), (d, p)
        if pages:
            last = pages[(owned - 1) // PAGE]
            assert not latent[last * PAGE + (owned - 1) % PAGE + 1 : (last + 1) * PAGE].any()


def test_a_transport_without_a_decode_route_fails_the_chunk(rng, geometry):
    device = kvshard.Device.cpu()
    placement, ranks, chain = prefill(device, geometry, rng, 2, 8, 100)
    layout = kvshard.shard.DecodeLayout.sglang(2)
    pools = [wrap(device, geometry, Placement(1), 0, 4, engine_tensors(geometry, 4)) for _ in range(2)]
    reg = DecodeRegistration(3, layout, 100, [DecodeRank.of(p, [1]) for p in pools])
    sender = Sender(ranks[0][0], method=Method.COPY_ENGINE)
    with pytest.raises(TransferError, match="1 destinations given"):
        sender.open_decode(reg, [RemoteSpace.of(pools[0])])
    sender.open_decode(reg, [RemoteSpace.of(p) for p in pools])
    with pytest.raises(ChunkFailedError, match="decode context-parallel layout") as e:
        sender.send(3, chain.pages, 100, last=True)
    assert not e.value.status.ok
    assert sender.pending_requests == 0
