"""kvshard as SGLang's data plane (``kvshard.sglang.adapter``), byte for byte against SGLang
0.5.23's own code on SGLang's own tensors, on the CPU.

Two identical sets of a CP group's pool tensors (latent rows, DSA indexer pages with a layer
that shares another's top-k, random bytes): SGLang's page-interleave pool code runs on one,
kvshard's ``PageInterleaveAdapter`` on the other, and every byte is compared:

- the batch plan: SGLang's ``begin_shard_extend`` (``_page_pos``, ``_block_pages``,
  ``_send_pages``) against the adapter's (``GatherPlan``);
- the owned-row write: SGLang's ``PageInterleaveMLATokenToKVPool.set_kv_buffer`` (its owner
  filter, ``index_select`` and ``MLATokenToKVPool.set_kv_buffer``) against ``set_kv_buffer``:
  every rank's latent rows, and its indexer pages untouched;
- the prefix gather: SGLang's ``_prefetch_layer`` (its ``index_select`` of the send block, run
  as SGLang wrote it) and the all-gather it hands NCCL, restated as what an all-gather does
  (each rank's block to every rank's slot), against the adapter's landing of every rank's pages
  into every rank's slot: every referenced scratch page, latent and indexer;
- the sharded P/D index preparation: SGLang's ``filter_kv_indices_for_shard_rank`` and
  ``_prepare_sharded_dsa_indices`` against ``kvshard.sglang.pd``;
- the pool class docs/sglang.md shows SGLang loading (its code block run as written) against
  SGLang's own class.

SGLang's pool objects are made without their constructors (which need a CUDA device, NCCL and
the server's process groups); their state is what ``_init_page_shard_state`` sets. The HiCache
host transfers run in the side-by-side benchmark's dry run (``python/sglang_bench.py --dry``,
``test_benchmark_dry_run`` below): SGLang's host pools' own transfer methods, their CUDA kernels
restated in torch, against the adapter's host pool, in every layout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import kvshard
from kvshard.error import InvalidArgumentError
from kvshard.geometry import PAGE_SIZE
from kvshard.shard import Placement, ShardAllocator
from kvshard.sglang.adapter import PageInterleaveAdapter
import sglang_oracle
from sglang_oracle import tally

PAGE = PAGE_SIZE
SKIP = (False, True, False)  # layer 1 reuses another layer's top-k: no indexer buffer
PPR = 12  # pages per rank, the padding page included


@pytest.fixture(scope="module")
def sg():
    return sglang_oracle.sglang(
        placement="mem_cache.page_interleave",
        pool="mem_cache.page_interleave_pool",
        pd="disaggregation.utils",
    )


class _Gather:
    """The all-gather SGLang hands its NCCL communicator, restated: ``all_gather(out, send)``
    records each rank's send block; ``run`` puts every rank's block at ``rank * block`` of every
    rank's output."""

    def __init__(self):
        self.calls = []

    def rank(self, r):
        outer = self

        class Comm:
            def change_state(self, enable=True):
                import contextlib

                return contextlib.nullcontext()

            def all_gather(self, out, send):
                outer.calls.append((r, out, send))

        return Comm()

    def run(self):
        # Each rank's k-th call (one per gathered tensor) is one collective of the group.
        by_rank: dict = {}
        for r, out, send in self.calls:
            by_rank.setdefault(r, []).append((out, send))
        for k in range(len(next(iter(by_rank.values()), []))):
            for _, calls in by_rank.items():
                out = calls[k][0]
                for r, theirs in by_rank.items():
                    send = theirs[k][1]
                    out[r * send.shape[0] : (r + 1) * send.shape[0]] = send
        self.calls.clear()


def tensors(rng, shard):
    """Per rank: latent rows ``[PPR * 64, 1, 576]`` and indexer pages ``[PPR, 8448]`` per layer
    (0 rows where the layer shares another's top-k), random bytes."""
    import torch

    out = []
    for _ in range(shard):
        kv = [torch.from_numpy(rng.integers(0, 256, (PPR * PAGE, 1, 576), dtype=np.uint8)) for _ in SKIP]
        ix = [
            torch.from_numpy(rng.integers(0, 256, (0 if s else PPR, 8448), dtype=np.uint8)) for s in SKIP
        ]
        out.append((kv, ix))
    return out


def clone(ts):
    return [([k.clone() for k in kv], [i.clone() for i in ix]) for kv, ix in ts]


def sglang_pool(sg, rank, shard, kv, ix, slots, comm, max_prefix, chunk, cls=None):
    """SGLang's ``PageInterleaveDSATokenToKVPool`` (or its subclass ``cls``) state for one rank
    over ``kv``/``ix``, its scratch slots ``slots`` (``{"kv", "index_k"}`` each; None: the
    class's own ``_alloc_scratch`` makes them, as ``_init_page_shard_state`` calls it), its
    all-gather ``comm``."""
    import torch

    spec = sg.placement.PageShardSpec(
        shard_rank=rank, shard_size=shard, page_size=PAGE, max_prefix_tokens=max_prefix, chunk_tokens=chunk
    )
    pool = object.__new__(cls or sg.pool.PageInterleaveDSATokenToKVPool)
    size = (PPR - 1) * PAGE
    trash = max_prefix + chunk
    pool.__dict__.update(
        shard_spec=spec, placement=sg.placement.PageInterleavePlacement(spec), shard_rank=rank,
        shard_size=shard, page_size=PAGE, device="cpu", size=size, start_layer=0, layer_num=len(SKIP),
        kv_buffer=kv, index_key_cache=SimpleNamespace(buffer=ix), dtype=torch.uint8, store_dtype=torch.uint8,
        dsa_kv_cache_store_fp8=False, requires_physical_write_loc=False, write_loc_is_dcp_resolved=True,
        _chunk_base=max_prefix, _trash_base=trash, _epoch=0, _local_page_stride=size // PAGE + 2,
        _debug_plan_checks=True, _translate_cache={}, _shard_extend_active=False, _block_pages=0,
        _send_pages=None, _send_rows=None, _write_plan_key=None, _write_plan=None,
        _page_pos=torch.full((shard * (size // PAGE + 2),), trash // PAGE, dtype=torch.int32),
        device_module=torch.cpu, kv_gather_stream=torch.cpu.Stream(), kv_gather_comm=comm,
        layer_transfer_counter=None,
    )
    if slots is None:
        slots, _ = pool._alloc_scratch(max_prefix + chunk + PAGE)
    pool._slots = [sg.pool._ScratchSlot(s, torch.cpu) for s in slots]
    return pool


def batch(shard, data_rng):
    """A batch over cached chains: requests ``(start_owner, prefix_pages, chunk_pages)``."""
    alloc = ShardAllocator(Placement(shard), PPR)
    chains = []
    for _ in range(2):
        a = alloc.alloc(int(data_rng.integers(shard, 2 * shard + 2)))
        chains.append((a.start_owner, a.pages))
    requests = []
    for i in range(3):
        start, pages = chains[i % 2]
        k = int(data_rng.integers(1, len(pages) + 1))
        chunk = alloc.alloc(int(data_rng.integers(1, shard + 2)), start, k * PAGE).pages
        requests.append((start, list(pages[:k]), chunk))
    return requests


@pytest.mark.parametrize("shard", [2, 4])
def test_adapter_is_sglangs_write_and_gather(sg, shard):
    import torch

    rng = np.random.default_rng(shard)
    requests = batch(shard, rng)
    prefix_pages = sum(-(-len(p) // shard) for _, p, _ in requests) * shard
    max_prefix = -(-prefix_pages * PAGE // (shard * PAGE)) * shard * PAGE
    chunk = sum(len(c) for _, _, c in requests) * PAGE
    theirs_t = tensors(rng, shard)
    ours_t = clone(theirs_t)

    adapters = [
        PageInterleaveAdapter(kv, ix, r, shard, max_prefix, chunk)
        for r, (kv, ix) in enumerate(ours_t)
    ]
    our_slots = [[a.scratch_slot() for _ in range(2)] for a in adapters]
    gather = _Gather()
    their_slots = [
        [{"kv": torch.zeros_like(s.kv), "index_k": torch.zeros_like(s.index_k)} for s in slots]
        for slots in our_slots
    ]
    pools = [
        sglang_pool(sg, r, shard, kv, ix, their_slots[r], gather.rank(r), max_prefix, chunk)
        for r, (kv, ix) in enumerate(theirs_t)
    ]

    # The batch plan. SGLang's begin_shard_extend kicks layer 0's gather (its pack) itself.
    width = max(len(p) + len(c) for _, p, c in requests) * PAGE
    req_to_token = torch.zeros((len(requests), width), dtype=torch.int32)
    prefix_lens, seq_lens = [], []
    for i, (_, prefix, chunk_pages) in enumerate(requests):
        slots = [p * PAGE + o for p in prefix + chunk_pages for o in range(PAGE)]
        req_to_token[i, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        prefix_lens.append(len(prefix) * PAGE)
        seq_lens.append(len(slots))
    for pool, adapter in zip(pools, adapters):
        pool.begin_shard_extend(req_to_token, torch.arange(len(requests)), prefix_lens, seq_lens)
        plan = adapter.begin_shard_extend(requests)
        n = shard * PPR
        assert adapter.page_pos[:n].tolist() == pool._page_pos[:n].tolist()
        assert plan.block == pool._block_pages == adapter.block_pages
        assert plan.send_list(adapter.shard_rank) == pool._send_pages.tolist()
    ops = 3 * shard

    loc = torch.tensor([p * PAGE + o for _, _, c in requests for p in c for o in range(PAGE)], dtype=torch.int64)
    mapped = sorted({p for _, pre, c in requests for p in pre + c})
    for layer in range(len(SKIP)):
        # Every rank writes the chunk's rows (replicated on every rank, as MLA latents are).
        rows = torch.from_numpy(rng.integers(0, 256, (loc.shape[0], 1, 576), dtype=np.uint8))
        if layer:
            for pool in pools:
                pool._prefetch_layer(layer)
        gather.run()
        for pool, adapter, slots in zip(pools, adapters, our_slots):
            pool.set_kv_buffer(SimpleNamespace(layer_id=layer), loc, rows, None)
            adapter.set_kv_buffer(layer, loc, rows)
            # The chunk into the slot stays SGLang's torch copy, onto the adapter's slot views.
            slots[layer % 2].kv[adapter.translate_loc_to_scratch(loc)] = rows
            for other in our_slots:
                adapter.land(layer, other[layer % 2])
        for adapter in adapters:
            adapter.device.synchronize()
        for r in range(shard):
            assert torch.equal(theirs_t[r][0][layer], ours_t[r][0][layer]), (r, layer)
            # The latent write leaves the indexer pages alone, as SGLang's does.
            assert torch.equal(theirs_t[r][1][layer], ours_t[r][1][layer]), (r, layer)
            theirs, ours = their_slots[r][layer % 2], our_slots[r][layer % 2]
            for p in mapped:
                s = int(pools[r]._page_pos[p])
                assert torch.equal(theirs["kv"][s * PAGE : (s + 1) * PAGE], ours.kv[s * PAGE : (s + 1) * PAGE]), (r, layer, p)
                if not SKIP[layer] and p in {q for _, pre, _ in requests for q in pre}:
                    assert torch.equal(theirs["index_k"][s], ours.index_k[s]), (r, layer, p)
            ops += 1 + len(mapped)
    for adapter in adapters:
        adapter.end_shard_extend()
    tally(f"adapter write and gather, CP{shard}", 1, ops)


def documented_pool_module():
    """The ``kvshard_pool.py`` code block of docs/sglang.md ("How SGLang's pool calls it"), run
    as a module; SGLang's configurator binding it makes is undone after the test."""
    import types

    doc = (Path(__file__).resolve().parents[2] / "docs" / "sglang.md").read_text()
    block = doc.split("### How SGLang's pool calls it", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert block.startswith("# kvshard_pool.py")
    module = types.ModuleType("kvshard_pool")
    exec(compile(block, "docs/sglang.md (kvshard_pool.py)", "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("shard", [2, 4])
def test_the_documented_pool_class_is_sglangs_pool_on_kvshard(sg, shard):
    """docs/sglang.md's pool class (SGLang's ``PageInterleaveDSATokenToKVPool`` with its write,
    plan and gather on the adapter) against SGLang's own class, the same batch on the same bytes:
    every rank's pool and every referenced scratch page (latent and indexer) after each layer's
    writes and gather; and SGLang's configurator builds the documented class."""
    import torch
    from sglang.srt.mem_cache import kv_cache_configurator

    own = kv_cache_configurator.PageInterleaveDSATokenToKVPool
    try:
        module = documented_pool_module()
        assert kv_cache_configurator.PageInterleaveDSATokenToKVPool is module.KvshardPageInterleaveDSAPool
    finally:
        kv_cache_configurator.PageInterleaveDSATokenToKVPool = own
    cls = module.KvshardPageInterleaveDSAPool
    assert issubclass(cls, own)

    rng = np.random.default_rng(10 + shard)
    requests = batch(shard, rng)
    max_prefix = sum(-(-len(p) // shard) for _, p, _ in requests) * shard * PAGE
    chunk = sum(len(c) for _, _, c in requests) * PAGE
    theirs_t = tensors(rng, shard)
    ours_t = clone(theirs_t)
    g_theirs, g_ours = _Gather(), _Gather()
    their_slots = [
        [{"kv": torch.zeros((max_prefix + chunk + PAGE, 1, 576), dtype=torch.uint8),
          "index_k": torch.zeros(((max_prefix + chunk) // PAGE + 1, 8448), dtype=torch.uint8)} for _ in range(2)]
        for _ in range(shard)
    ]
    theirs = [sglang_pool(sg, r, shard, kv, ix, their_slots[r], g_theirs.rank(r), max_prefix, chunk) for r, (kv, ix) in enumerate(theirs_t)]
    ours = [sglang_pool(sg, r, shard, kv, ix, None, g_ours.rank(r), max_prefix, chunk, cls) for r, (kv, ix) in enumerate(ours_t)]

    width = max(len(p) + len(c) for _, p, c in requests) * PAGE
    req_to_token = torch.zeros((len(requests), width), dtype=torch.int32)
    prefix_lens, seq_lens = [], []
    for i, (_, prefix, chunk_pages) in enumerate(requests):
        slots = [p * PAGE + o for p in prefix + chunk_pages for o in range(PAGE)]
        req_to_token[i, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        prefix_lens.append(len(prefix) * PAGE)
        seq_lens.append(len(slots))
    for pools in (theirs, ours):
        for pool in pools:
            pool.begin_shard_extend(req_to_token, torch.arange(len(requests)), prefix_lens, seq_lens)
    for a, b in zip(theirs, ours):
        assert a._page_pos.tolist() == b._page_pos.tolist() and a._block_pages == b._block_pages

    loc = torch.tensor([p * PAGE + o for _, _, c in requests for p in c for o in range(PAGE)], dtype=torch.int64)
    prefix_pages = {q for _, pre, _ in requests for q in pre}
    mapped = sorted(prefix_pages | {p for _, _, c in requests for p in c})
    ops = 0
    for layer in range(len(SKIP)):
        rows = torch.from_numpy(rng.integers(0, 256, (loc.shape[0], 1, 576), dtype=np.uint8))
        for pools in (theirs, ours):
            if layer:
                for pool in pools:
                    pool._prefetch_layer(layer)
        # kvshard's CPU backend runs its queued landings when waited for (on a GPU the
        # all-gather is ordered after them on the gather stream).
        ours[0].kvshard.device.synchronize()
        g_theirs.run()
        g_ours.run()
        for a, b in zip(theirs, ours):
            a.set_kv_buffer(SimpleNamespace(layer_id=layer), loc, rows, None)
            b.set_kv_buffer(SimpleNamespace(layer_id=layer), loc, rows, None)
        ours[0].kvshard.device.synchronize()
        for r, (a, b) in enumerate(zip(theirs, ours)):
            assert torch.equal(a.kv_buffer[layer], b.kv_buffer[layer]), (r, layer)
            x, y = a._slots[layer % 2].tensors, b._slots[layer % 2].tensors
            for p in mapped:
                s_ = int(a._page_pos[p])
                assert torch.equal(x["kv"][s_ * PAGE : (s_ + 1) * PAGE], y["kv"][s_ * PAGE : (s_ + 1) * PAGE]), (r, layer, p)
                if not SKIP[layer] and p in prefix_pages:
                    assert torch.equal(x["index_k"][s_], y["index_k"][s_]), (r, layer, p)
            ops += 1 + len(mapped)
    tally(f"documented pool class, CP{shard}", 1, ops)


def test_adapter_refuses_what_it_cannot_place(sg):
    """A latent row width kvshard has no layout for, a batch whose prefix owners are not cyclic
    along its chain, a chunk past the staging and a layer past the pool are refused before
    anything moves."""
    import torch

    with pytest.raises(InvalidArgumentError, match="500 B"):
        PageInterleaveAdapter(
            [torch.zeros((PPR * PAGE, 1, 500), dtype=torch.uint8)], None, 0, 2, 2 * PAGE, PAGE
        )
    adapter = PageInterleaveAdapter(
        [torch.zeros((PPR * PAGE, 1, 576), dtype=torch.uint8)], None, 0, 2, 4 * PAGE, 2 * PAGE
    )
    before = adapter.page_pos.clone()
    with pytest.raises(kvshard.KvshardError):
        adapter.begin_shard_extend([(0, [2, 4], [6])])  # owners 0, 0: not cyclic from 0
    assert torch.equal(adapter.page_pos, before)
    # A chunk longer than the staging, a layer the pool does not have: refused, nothing written.
    pool = adapter.layers[0][0].clone()
    loc = torch.arange(2 * PAGE, 5 * PAGE, dtype=torch.int64)
    with pytest.raises(InvalidArgumentError, match="staging"):
        adapter.set_kv_buffer(0, loc, torch.ones((3 * PAGE, 1, 576), dtype=torch.uint8))
    with pytest.raises(InvalidArgumentError, match="layer 1"):
        adapter.set_kv_buffer(1, loc[:PAGE], torch.ones((PAGE, 1, 576), dtype=torch.uint8))
    adapter.device.synchronize()
    assert torch.equal(adapter.layers[0][0], pool)


@pytest.mark.parametrize("shard", [2, 3, 4])
def test_pd_index_preparation_is_sglangs(sg, shard):
    """``kvshard.sglang.pd`` against SGLang's own ``filter_kv_indices_for_shard_rank`` and
    ``_prepare_sharded_dsa_indices`` (compiled from its source, unmodified), every rank, random
    chunks of random chains."""
    from kvshard.sglang import pd

    prepare = sglang_oracle.sglang_function(
        "disaggregation.mooncake.conn",
        "MooncakeKVManager._prepare_sharded_dsa_indices",
        np=np,
        filter_kv_indices_for_shard_rank=sg.pd.filter_kv_indices_for_shard_rank,
    )
    rng = np.random.default_rng(shard)
    ops = 0
    for _ in range(20):
        pages = rng.permutation(np.arange(shard, 40 * shard))[: int(rng.integers(1, 30))].astype(np.int32)
        start = int(rng.integers(0, len(pages)))
        dst = rng.permutation(np.arange(1, 1000))[: len(pages)].astype(np.int32)
        for rank in range(shard):
            args = dict(kv_indices=pages[start:], index_slice=slice(start, len(pages)), shard_rank=rank, shard_size=shard)
            a, b = sg.pd.filter_kv_indices_for_shard_rank(**args)
            c, d = pd.filter_kv_indices_for_shard_rank(**args)
            assert a.tolist() == c.tolist() and b.tolist() == d.tolist()
            assert a.dtype == c.dtype and b.dtype == d.dtype
            e, f = prepare(SimpleNamespace(kv_shard_rank=rank, kv_shard_size=shard), pages, dst)
            g, h = pd.prepare_sharded_dsa_indices(pages, dst, shard_rank=rank, shard_size=shard)
            assert e.tolist() == g.tolist() and f.tolist() == h.tolist()
            ops += 2
    with pytest.raises(InvalidArgumentError):
        pd.prepare_sharded_dsa_indices([shard], [1, 2], shard_rank=0, shard_size=shard)
    tally(f"P/D index preparation, CP{shard}", 20, ops)


def test_benchmark_dry_run(tmp_path):
    """``python/sglang_bench.py --dry``: every path of the H200 side-by-side benchmark (SGLang's
    own page-interleave write and gather, its MLA and DSA host pools' transfers in every layout,
    against the adapter) at tiny shapes on the CPU, every result compared byte for byte; so the
    GPU run cannot fail on a typo. Its table and chart are written."""
    sglang_oracle.sglang()
    bench = Path(__file__).resolve().parents[1] / "sglang_bench.py"
    env = dict(os.environ, OUT=str(tmp_path))
    run = subprocess.run(
        [sys.executable, "-P", str(bench), "--dry"], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    table = (tmp_path / "sglang.md").read_text()
    assert "kvshard's results: every one byte-identical to SGLang's." in table, table
    rows = [line for line in table.splitlines() if line.startswith("| ") and line.endswith("| byte-identical |")]
    assert len(rows) == 28, table
    tally("benchmark dry run", 1, len(rows))
