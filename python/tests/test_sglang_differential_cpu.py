"""kvshard against SGLang 0.5.23's own page-sharding code, side by side on the CPU.

Random operation sequences (hypothesis) run SGLang's real objects and kvshard's Python package
on the same inputs and compare every answer:

- the placement bijection (``PageInterleavePlacement``: owners, local rows, local pages, and the
  inverse) against ``Placement``;
- the allocator (``PageInterleavePoolAllocator`` with ``need_sort=True``, as SGLang builds it
  for P/D prefill, the only mode sharding runs in) against ``ShardAllocator``: batches
  of new chains and extensions (rotation bases resolved at each request's turn), frees, the
  release order, load-back allocations (SGLang's ``alloc_cyclic`` against kvshard's
  ``alloc_matching``), available and admission capacity, every page's state after every step;
- the host pool (``PageInterleaveHostPool`` over SGLang's own MLA host pool): owner classes of
  its allocations and ``owned_rows`` against kvshard's ``TransferPlan.from_slots``;
- the P/D send filter (``filter_kv_indices_for_shard_rank``) and the sharded DSA state indices
  (``_prepare_sharded_dsa_indices``) against the descriptors of kvshard's ``MooncakeSender``;
- the gather plan (``begin_shard_extend``'s scratch page of every logical page and this rank's
  send list) against ``GatherPlan``, and the scratch sizing and per-batch admission
  (``PageShardSpec``, ``PrefillAdder._kv_shard_reserve_scratch``) against ``Budget``
  and ``Admission``.

The differences that remain are kvshard's deliberate strictness, each tested here and listed in
docs/sglang.md: kvshard refuses what SGLang asserts only in debug mode or not at all.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import kvshard
from kvshard.error import InvalidArgumentError
from kvshard.geometry import CacheGeometry, Component, LatentLayout, PAGE_SIZE, PoolGeometry
from kvshard.pool import Budget, DevicePool, PoolLayout
from kvshard.shard import Admission, GatherPlan, Placement, ShardAllocator
from kvshard.transfer import MooncakeMode, Registration, engine_memory
import sglang_oracle
from sglang_oracle import tally

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError as why:
    sglang_oracle.unavailable(f"the differential tests need hypothesis, which does not import ({why})")

PAGE = PAGE_SIZE
EXAMPLES = int(os.environ.get("KVSHARD_SGLANG_EXAMPLES", "150"))
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@pytest.fixture(scope="module")
def sg():
    return sglang_oracle.sglang(
        placement="mem_cache.page_interleave",
        allocator="mem_cache.allocator.page_interleave",
        pd="disaggregation.utils",
    )


def torch():
    import torch as t

    return t


# --- the placement bijection ----------------------------------------------------------------


@SETTINGS
@given(shard=st.sampled_from([2, 3, 4, 8]), data=st.data())
def test_placement_bijection_matches_sglang(sg, shard, data):
    t = torch()
    spec = sg.placement.PageShardSpec(
        shard_rank=0, shard_size=shard, page_size=PAGE, max_prefix_tokens=shard * PAGE, chunk_tokens=PAGE
    )
    theirs = sg.placement.PageInterleavePlacement(spec)
    ours = Placement(shard)
    slots = data.draw(st.lists(st.integers(0, (1 << 40) - 1), min_size=1, max_size=64))
    loc = t.tensor(slots, dtype=t.int64)
    owners = theirs.owner_of(loc).tolist()
    local = theirs.local_index(loc).tolist()
    assert owners == [ours.slot_owner(s) for s in slots]
    assert local == [ours.local_row(s) for s in slots]
    for s, o, row in zip(slots, owners, local):
        page = s // PAGE
        assert ours.owner(page) == o
        assert ours.local(page) == row // PAGE
        # The inverse: the logical page of (owner, local page) is the page again.
        assert ours.logical(o, row // PAGE) == page
        assert ours.is_reserved(page) == (page < shard)
    for rank in range(shard):
        filtered = theirs.filter_local(loc, rank).tolist()
        assert filtered == [ours.local_row(s) for s in slots if ours.slot_owner(s) == rank]
    tally("placement", 1, len(slots) * (4 + shard))


# --- the allocator -----------------------------------------------------------------------------


class Pair:
    """SGLang's allocator and kvshard's, driven together."""

    def __init__(self, sg, shard: int, pages_per_rank: int):
        t = torch()
        self.t = t
        self.shard = shard
        self.ppr = pages_per_rank
        self.theirs = sg.allocator.PageInterleavePoolAllocator(
            size=(pages_per_rank - 1) * PAGE,
            physical_page_size=PAGE,
            shard_size=shard,
            dtype=t.int64,
            device="cpu",
            kvcache=None,
            need_sort=True,
        )
        self.ours = ShardAllocator(Placement(shard), pages_per_rank)
        self.chains: list[dict] = []
        self.ops = 0

    def compare_state(self):
        theirs, ours = self.theirs, self.ours
        assert theirs.class_free_page_counts() == [ours.free_pages(r) for r in range(self.shard)]
        assert theirs.available_size() == ours.admission_capacity()
        assert theirs.aggregate_free_size() == ours.total_free() * PAGE
        free = set(theirs.get_all_free_pages().tolist())
        for page in range(self.shard, self.shard * self.ppr):
            assert ours.is_allocated(page) == (page not in free), page
        self.ops += 1

    def extend(self, requests):
        """``requests``: (chain index or None, new pages, tokens of the last page)."""
        t = self.t
        prefix, seq, bases, kv = [], [], [], []
        for chain, pages, last_tokens in requests:
            start = 0 if chain is None else len(self.chains[chain]["pages"]) * PAGE
            prefix.append(start)
            seq.append(start + (pages - 1) * PAGE + last_tokens)
            bases.append(None if chain is None else self.chains[chain]["start"])
            kv.append((pages, None if chain is None else self.chains[chain]["start"], start))
        resolved = list(bases)
        p, s = t.tensor(prefix, dtype=t.int64), t.tensor(seq, dtype=t.int64)
        out = self.theirs.alloc_extend(
            p, p, s, s, t.zeros(len(requests), dtype=t.int64), int((s - p).sum()), rotation_bases=resolved
        )
        try:
            got = self.ours.alloc_batch(kv)
        except kvshard.KvshardError:
            got = None
        assert (out is None) == (got is None), (out, got)
        if out is not None:
            offset = 0
            for (chain, pages, _), a, base, n in zip(requests, got, resolved, (s - p).tolist()):
                mine = out[offset : offset + n]
                offset += n
                theirs_pages = (mine[::PAGE] // PAGE).tolist()
                assert a.start_owner == base
                assert a.pages == theirs_pages
                if chain is None:
                    self.chains.append({"start": base, "pages": list(a.pages)})
                else:
                    self.chains[chain]["pages"] += a.pages
        self.compare_state()

    def free(self, chain: int, keep: int):
        pages = self.chains[chain]["pages"]
        gone, self.chains[chain]["pages"] = pages[keep:], pages[:keep]
        if not self.chains[chain]["pages"]:
            self.chains.pop(chain)
        t = self.t
        slots = t.tensor([p * PAGE + o for p in gone for o in range(PAGE)], dtype=t.int64)
        self.theirs.free(slots)
        self.ours.free(gone)
        self.compare_state()

    def load_back(self, chain: int):
        """A HiCache load of a cached chain into new device pages: SGLang's ``alloc_cyclic``
        (start class = the first page's owner), kvshard's ``alloc_matching``."""
        pages = self.chains[chain]["pages"]
        out = self.theirs.alloc_cyclic(start_class=pages[0] % self.shard, need_size=len(pages) * PAGE)
        try:
            got = self.ours.alloc_matching(pages)
        except kvshard.KvshardError:
            got = None
        assert (out is None) == (got is None)
        if out is not None:
            assert got == (out[::PAGE] // PAGE).tolist()
            self.chains.append({"start": pages[0] % self.shard, "pages": list(got)})
        self.compare_state()


@SETTINGS
@given(shard=st.sampled_from([2, 3, 4]), ppr=st.integers(2, 10), data=st.data())
def test_allocator_matches_sglang(sg, shard, ppr, data):
    pair = Pair(sg, shard, ppr)
    pair.compare_state()
    for _ in range(data.draw(st.integers(1, 30))):
        kind = data.draw(st.sampled_from(["extend", "extend", "free", "load_back"]))
        if kind == "extend":
            n = data.draw(st.integers(1, 3))
            live = list(range(len(pair.chains)))
            requests = []
            for _ in range(n):
                chain = data.draw(st.sampled_from([None] + live)) if live else None
                if chain is not None:
                    live.remove(chain)
                pages = data.draw(st.integers(1, shard * 3))
                requests.append((chain, pages, data.draw(st.integers(1, PAGE))))
            pair.extend(requests)
        elif kind == "free" and pair.chains:
            chain = data.draw(st.integers(0, len(pair.chains) - 1))
            keep = data.draw(st.integers(0, len(pair.chains[chain]["pages"]) - 1))
            pair.free(chain, keep)
        elif kind == "load_back" and pair.chains:
            pair.load_back(data.draw(st.integers(0, len(pair.chains) - 1)))
    tally("allocator", 1, pair.ops)



# --- the host pool: owner classes of host slots, owned rows ------------------------------------


@SETTINGS
@given(shard=st.sampled_from([2, 3, 4]), ppr=st.integers(3, 10), data=st.data())
def test_host_slots_and_owned_rows_match_sglang(sg, shard, ppr, data):
    """SGLang's sharded host slots (``PageInterleaveHostPool.alloc``: ``alloc_cyclic`` on an
    allocator with ``need_sort=False``) against kvshard's host allocator (``alloc_matching``):
    the same owner class for every page and the same free counts, but not always the same pages
    (SGLang's host allocator hands a freed page out again at once, kvshard's through its release
    order: docs/sglang.md). ``owned_rows`` against ``TransferPlan.from_slots``: this rank's
    (host, device) local rows of every owned pair, in order."""
    t = torch()
    theirs = sg.allocator.PageInterleavePoolAllocator(
        size=(ppr - 1) * PAGE, physical_page_size=PAGE, shard_size=shard, dtype=t.int64,
        device="cpu", kvcache=None, need_sort=False,
    )
    ours = ShardAllocator(Placement(shard), ppr)
    # Pairs of (SGLang's pages, kvshard's pages) handed out by the same call.
    held: list[tuple[list[int], list[int]]] = []
    ops = 0
    for _ in range(data.draw(st.integers(1, 12))):
        if held and data.draw(st.booleans()):
            mine, yours = held.pop(data.draw(st.integers(0, len(held) - 1)))
            theirs.free(t.tensor([p * PAGE for p in mine], dtype=t.int64))
            ours.free(yours)
        else:
            start = data.draw(st.integers(0, shard - 1))
            n = data.draw(st.integers(1, 2 * shard))
            # alloc_matching copies the owners of the pages it is given: a cyclic run from start.
            owners_of = [shard + (start + j) % shard for j in range(n)]
            out = theirs.alloc_cyclic(start_class=start, need_size=n * PAGE)
            try:
                got = ours.alloc_matching(owners_of)
            except kvshard.KvshardError:
                got = None
            assert (out is None) == (got is None)
            if got is not None:
                mine = (out[::PAGE] // PAGE).tolist()
                assert [p % shard for p in mine] == [p % shard for p in got]
                held.append((mine, got))
        assert theirs.class_free_page_counts() == [ours.free_pages(r) for r in range(shard)]
        assert theirs.available_size() == ours.admission_capacity()
        ops += 1
    tally("host slots", 1, ops)


@SETTINGS
@given(shard=st.sampled_from([2, 3, 4]), data=st.data())
def test_owned_rows_match_sglang(sg, shard, data):
    t = torch()
    from sglang.srt.mem_cache.pool_host import page_interleave as host_pool

    placement = sg.placement.PageInterleavePlacement(
        sg.placement.PageShardSpec(
            shard_rank=0, shard_size=shard, page_size=PAGE, max_prefix_tokens=shard * PAGE, chunk_tokens=PAGE
        )
    )
    pages = 10
    n = data.draw(st.integers(0, pages - 1))
    # Owner-matched pairs of logical host and device pages (as SGLang's controller makes them).
    # Distinct pages on each side (kvshard refuses a page named twice in one transfer: a
    # deliberate strictness; SGLang's owned_rows does not look).
    owners = data.draw(st.lists(st.integers(0, shard - 1), min_size=n, max_size=n))
    host_local = data.draw(st.permutations(list(range(1, pages))))
    device_local = data.draw(st.permutations(list(range(1, pages))))
    host_pages = [host_local[i % (pages - 1)] * shard + o for i, o in enumerate(owners)]
    device_pages = [device_local[i % (pages - 1)] * shard + o for i, o in enumerate(owners)]
    host = t.tensor([p * PAGE + o for p in host_pages for o in range(PAGE)], dtype=t.int64)
    device = t.tensor([p * PAGE + o for p in device_pages for o in range(PAGE)], dtype=t.int64)
    ours_placement = Placement(shard)
    for rank in range(shard):
        facade = object.__new__(host_pool.PageInterleaveHostPool)
        facade.__dict__.update(placement=placement, shard_rank=rank, shard_size=shard)
        h_rows, d_rows = host_pool.PageInterleaveHostPool.owned_rows(facade, host, device)
        plan = kvshard.hicache.TransferPlan.from_slots(
            ours_placement, rank, np.asarray(device.numpy()), np.asarray(host.numpy()), pages, pages
        )
        assert plan.device_pages == (d_rows[::PAGE] // PAGE).tolist()
        assert plan.host_pages == (h_rows[::PAGE] // PAGE).tolist()
    tally("owned rows", 1, shard)


# --- the gather plan -----------------------------------------------------------------------------


def sglang_gather(sg, shard, rank, ppr, max_prefix_tokens, chunk_tokens, requests):
    """SGLang's ``begin_shard_extend`` on the pool mixin's own state (no NCCL, no scratch
    tensors: the gather it would start is not run). Returns ``(block, page_pos, send_pages)``,
    or the AssertionError SGLang raises for a batch that overflows its scratch."""
    t = torch()
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveKVPoolMixin

    spec = sg.placement.PageShardSpec(
        shard_rank=rank, shard_size=shard, page_size=PAGE,
        max_prefix_tokens=max_prefix_tokens, chunk_tokens=chunk_tokens,
    )
    pool = object.__new__(PageInterleaveKVPoolMixin)
    size = (ppr - 1) * PAGE  # SGLang's per-rank token capacity; page 0 is the padding page
    trash = max_prefix_tokens + chunk_tokens
    pool.__dict__.update(
        shard_spec=spec, shard_rank=rank, shard_size=shard, page_size=PAGE, device="cpu", size=size,
        start_layer=0, _chunk_base=max_prefix_tokens, _trash_base=trash, _epoch=0,
        _local_page_stride=size // PAGE + 2, _debug_plan_checks=True, _translate_cache={},
        _page_pos=t.full((shard * (size // PAGE + 2),), trash // PAGE, dtype=t.int32),
        _prefetch_layer=lambda layer: None,
    )
    width = max([len(p) + len(c) for _, p, c in requests] + [1]) * PAGE
    req_to_token = t.zeros((len(requests), width), dtype=t.int32)
    prefix_lens, seq_lens = [], []
    for i, (_, prefix, chunk) in enumerate(requests):
        slots = [p * PAGE + o for p in prefix + chunk for o in range(PAGE)]
        req_to_token[i, : len(slots)] = t.tensor(slots, dtype=t.int32)
        prefix_lens.append(len(prefix) * PAGE)
        seq_lens.append(len(slots))
    pool.begin_shard_extend(req_to_token, t.arange(len(requests)), prefix_lens, seq_lens)
    send = pool._send_pages.tolist() if pool._send_pages is not None else []
    return pool._block_pages, pool._page_pos.tolist(), send


@SETTINGS
@given(shard=st.sampled_from([2, 3, 4]), data=st.data())
def test_gather_plan_matches_sglang(sg, shard, data):
    """A batch of requests over cached chains (several may share a chain's prefix) and their new
    chunk pages: SGLang's scratch page of every logical page, block and send lists against
    ``GatherPlan``, on every rank; a batch that overflows the scratch is refused by both."""
    ppr = 24
    alloc = ShardAllocator(Placement(shard), ppr)
    chains = []
    for _ in range(data.draw(st.integers(1, 3))):
        a = alloc.alloc(data.draw(st.integers(1, 2 * shard + 1)))
        chains.append((a.start_owner, a.pages))
    requests = []
    for _ in range(data.draw(st.integers(1, 4))):
        start, pages = chains[data.draw(st.integers(0, len(chains) - 1))]
        k = data.draw(st.integers(0, len(pages)))
        new = data.draw(st.integers(0 if k else 1, shard + 1))
        chunk = alloc.alloc(new, start, k * PAGE).pages if new else []
        requests.append((start, list(pages[:k]), chunk))
    max_prefix = data.draw(st.integers(1, 4)) * shard * PAGE
    chunk_tokens = data.draw(st.integers(1, 4 * shard)) * PAGE
    ours = theirs = None
    try:
        ours = GatherPlan(Placement(shard), max_prefix, chunk_tokens, shard * ppr, requests)
    except kvshard.KvshardError:
        pass
    for rank in range(shard):
        try:
            theirs = sglang_gather(sg, shard, rank, ppr, max_prefix, chunk_tokens, requests)
        except AssertionError:
            theirs = None
        assert (theirs is None) == (ours is None), (requests, max_prefix, chunk_tokens)
        if ours is None:
            continue
        block, page_pos, send = theirs
        assert ours.block == block
        assert ours.page_table() == page_pos[: shard * ppr]
        assert ours.send_list(rank) == send
    tally("gather plan", 1, shard)


# --- admission and scratch sizing --------------------------------------------------------------


def sglang_adder(sg_spec, shard):
    """The scheduler state SGLang's ``PrefillAdder._kv_shard_reserve_scratch`` reads, fresh."""
    from types import SimpleNamespace

    return SimpleNamespace(
        kv_shard_scratch_spec=sg_spec, kv_shard_granule=PAGE, kv_shard_size=shard,
        kv_shard_block_bound_pages=0, kv_shard_chunk_pages=0,
    )


@SETTINGS
@given(shard=st.sampled_from([2, 3, 4, 8]), data=st.data())
def test_admission_matches_sglang(sg, shard, data):
    """A scheduling pass: random requests offered in turn to SGLang's scratch reservation and
    to ``Admission``. SGLang's scheduler first cuts a request's extension to the chunk
    room left, floored to whole pages (``add_chunked_req``), then reserves; kvshard's ``offer``
    does both. Every answer (admitted, deferred, never admissible) and the batch's block and
    chunk pages agree. The pool's capacity is not in play here (kvshard's pool deferral is
    tested against the allocator's admission capacity above)."""
    reserve = sglang_oracle.sglang_function("managers.schedule_policy", "PrefillAdder._kv_shard_reserve_scratch")
    max_prefix = data.draw(st.integers(1, 6)) * shard * PAGE
    chunk_tokens = data.draw(st.integers(1, 16)) * PAGE
    spec = sg.placement.PageShardSpec(
        shard_rank=0, shard_size=shard, page_size=PAGE, max_prefix_tokens=max_prefix, chunk_tokens=chunk_tokens
    )
    adder = sglang_adder(spec, shard)
    ours = Admission(Placement(shard), max_prefix, chunk_tokens, 1 << 60)
    offers = data.draw(st.integers(1, 8))
    for _ in range(offers):
        prefix = data.draw(st.integers(0, max_prefix // PAGE + shard)) * PAGE
        extend = data.draw(st.integers(1, chunk_tokens + 3 * PAGE))
        room = chunk_tokens - adder.kv_shard_chunk_pages * PAGE
        whole = -(-extend // PAGE) * PAGE
        ask = extend if whole <= room else (room // PAGE * PAGE or extend)
        try:
            mine = reserve(adder, prefix, ask)
        except RuntimeError:
            mine = "never"
        try:
            got = ours.offer(prefix, extend)
        except InvalidArgumentError:
            got = "never"
        if mine == "never" or got == "never":
            assert mine == got, (prefix, extend, ask)
            break
        assert mine == (got is not None), (prefix, extend, ask, got)
        if got is not None:
            assert got == (ask, ask == extend)
        assert (ours.block, ours.chunk_pages) == (adder.kv_shard_block_bound_pages, adder.kv_shard_chunk_pages)
    tally("admission", 1, offers)


@SETTINGS
@given(
    shard=st.sampled_from([2, 4, 8]),
    context=st.integers(1, 200_000),
    chunk=st.integers(1, 32_768),
    latent=st.sampled_from(["FP8_TRTLLM", "FP8_SCALED"]),
    mtp=st.booleans(),
)
def test_scratch_sizing_matches_sglang(sg, shard, context, chunk, latent, mtp):
    """SGLang's scratch spec and bytes (``make_page_shard_spec``, ``compute_page_shard_scratch_bytes``
    for a DSA model: latent row + indexer key + scale per row, doubled with the MTP draft)
    against ``Budget``. The rank topology, server arguments and the latent row width
    SGLang derives from its attention backend are its inputs, given here."""
    from types import SimpleNamespace

    t = torch()
    pi = sg.placement
    row = {"FP8_TRTLLM": 576, "FP8_SCALED": 656}[latent]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pi, "get_kv_shard_group_info", lambda kvc: (0, shard))
        mp.setattr(pi, "get_schedule", lambda: SimpleNamespace(chunked_prefill_size=chunk))
        mp.setattr(pi, "get_spec", lambda: SimpleNamespace(enable_multi_layer_eagle=False))
        from sglang.srt.mem_cache import kv_cache_configurator

        mp.setattr(kv_cache_configurator, "calculate_mla_kv_cache_dim", lambda **kw: row)
        kvc = SimpleNamespace(
            is_draft_worker=False, page_size=PAGE, use_mla_backend=True, kv_cache_dtype=t.float8_e4m3fn,
            model_config=SimpleNamespace(
                context_len=context,
                hf_config=SimpleNamespace(
                    architectures=["DeepseekV32ForCausalLM"], index_head_dim=128, index_topk=2048
                ),
            ),
            spec_algorithm=pi.SpeculativeAlgorithm.EAGLE,
            spec_aux_config=SimpleNamespace(eagle_draft_num_layers=1),
        )
        spec = pi.make_page_shard_spec(kvc)
        scratch = pi.compute_page_shard_scratch_bytes(kvc, include_mtp=mtp)
        geometry = CacheGeometry.deepseek_v32(getattr(LatentLayout, latent), mtp=mtp)
        budget = Budget.plan(1 << 40, context, chunk, geometry, Placement(shard))
        assert budget.max_prefix_tokens == spec.max_prefix_tokens
        assert budget.scratch_rows == spec.scratch_rows
        assert budget.scratch_bytes == scratch
    tally("scratch sizing", 1, 3)


# --- the P/D send filter and the sharded DSA state indices -------------------------------------


def _pd_geometry():
    return CacheGeometry(
        PoolGeometry(LatentLayout.FP8_TRTLLM, indexer_layers=[True, False]), draft=True
    )


def _expand(chunk, src_bases, dst_bases, blocks, src_pages):
    """The (source local page, destination page) pairs of every (component, layer) a chunk's
    descriptors move, by component index and layer."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for src, dst, length in zip(chunk.src_addrs, chunk.dst_addrs, chunk.lengths):
        for c, layers in enumerate(src_bases):
            hit = next((i for i, base in enumerate(layers) if base <= src < base + src_pages * blocks[c]), None)
            if hit is None:
                continue
            block = blocks[c]
            s0 = (src - layers[hit]) // block
            d0 = (dst - dst_bases[c][hit]) // block
            assert length % block == 0
            out.setdefault((c, hit), []).extend((s0 + i, d0 + i) for i in range(length // block))
            break
    return out


@SETTINGS
@given(shard=st.sampled_from([2, 3, 4]), data=st.data())
def test_pd_send_filter_matches_sglang(sg, shard, data):
    """One request sent chunk by chunk from every prefill rank: the (local source page,
    destination page) pairs of kvshard's ``MooncakeSender`` descriptors, per chunk, against
    SGLang's ``filter_kv_indices_for_shard_rank`` over the chunk's positions (latent KV, every
    layer the same) and, with the final chunk, ``_prepare_sharded_dsa_indices`` over the whole
    sequence (the indexer state)."""
    from types import SimpleNamespace

    prepare = sglang_oracle.sglang_function(
        "disaggregation.mooncake.conn",
        "MooncakeKVManager._prepare_sharded_dsa_indices",
        np=np,
        filter_kv_indices_for_shard_rank=sg.pd.filter_kv_indices_for_shard_rank,
    )
    geometry = _pd_geometry()
    dev = kvshard.Device.cpu()
    src_ppr, decode_pages = 16, 64
    placement = Placement(shard)
    alloc = ShardAllocator(placement, src_ppr)
    total = data.draw(st.integers(1, 3 * shard + 2))
    src = alloc.alloc(total).pages
    prefix = data.draw(st.integers(0, total - 1))
    order = data.draw(st.permutations(list(range(1, decode_pages))))
    state_dst = [int(x) for x in order[:total]]
    kv_dst = [int(x) for x in order[total : total + total - prefix]]
    cuts = sorted(set(data.draw(st.lists(st.integers(prefix + 1, total), max_size=3))) | {total})
    decode = DevicePool.allocate(dev, geometry, Placement(1), 0, decode_pages)
    _, dst_bases = engine_memory(decode)
    blocks = [c.block_bytes for c in geometry.components()]
    indexer = next(i for i, c in enumerate(geometry.components()) if c.component == Component.TARGET_INDEXER)
    ops = 0
    for rank in range(shard):
        pool = DevicePool.allocate(dev, geometry, placement, rank, src_ppr)
        _, src_bases = engine_memory(pool)
        sender = kvshard.transfer.MooncakeSender(pool, dst_bases, decode_pages, mode=MooncakeMode.COALESCED)
        layout = PoolLayout.packed(geometry, decode_pages)
        sender.open(Registration(1, layout, kv_dst, state_dst, prefix))
        start = prefix
        for end in cuts:
            last = end == total
            chunk = sender.send(1, src[:end], end * PAGE, last=last)
            moved = _expand(chunk, src_bases, dst_bases, blocks, src_ppr)
            local, positions = sg.pd.filter_kv_indices_for_shard_rank(
                kv_indices=np.asarray(src[start:end], dtype=np.int32),
                index_slice=slice(start - prefix, end - prefix),
                shard_rank=rank,
                shard_size=shard,
            )
            want_kv = sorted(zip(local.tolist(), np.asarray(kv_dst)[positions].tolist()))
            latent = moved.get((0, 0), [])
            assert sorted(latent) == want_kv, (rank, start, end, src, prefix, kv_dst, moved)
            if last:
                manager = SimpleNamespace(kv_shard_rank=rank, kv_shard_size=shard)
                s_local, s_dst = prepare(manager, src, state_dst)
                assert sorted(moved.get((indexer, 0), [])) == sorted(zip(s_local.tolist(), s_dst.tolist()))
            else:
                assert (indexer, 0) not in moved
            chunk.landed(0.0)
            assert chunk.poll() is not None
            start = end
            ops += 1
    tally("P/D send filter", 1, ops)


# --- the host pools' byte layouts, offset by offset ----------------------------------------------

HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
LAYOUT_SKIP = (False, True, False)  # layer 1 shares another layer's top-k: no indexer buffer


@pytest.fixture(scope="module")
def host_layouts(sg):
    """Per host layout: SGLang's own MLA and DSA indexer host pools (``pin_memory=False``) and
    kvshard's ``MLAHostPool`` wrapping their buffers (``adopt_sglang_pools``, as the storage
    backend and the data-plane adapter wrap them)."""
    from kvshard.sglang_storage import adopt_sglang_pools

    out = {}
    for layout in HOST_LAYOUTS:
        built = sglang_oracle.host_pools(layout, skip=LAYOUT_SKIP, pages=6)
        out[layout] = (built, adopt_sglang_pools(built.kv, built.indexer))
    return out


def _addr(t) -> int:
    return t.data_ptr()


def _ours(ours, component, layer, page, row, byte):
    """kvshard's address of a byte twice: from ``HostPool.row_offset`` and from the buffer's
    strides (kvshard's own layout math); both must agree."""
    host = ours.host
    index, first = host.component_buffer(component)
    base = host.host_ptr(index)
    by_offset = base + host.row_offset(component, layer, page, row) + byte
    layer_stride, page_stride, row_stride = host.buffer_layouts()[index].strides
    by_strides = base + (first + layer) * layer_stride + page * page_stride + row * row_stride + byte
    assert by_offset == by_strides, (component, layer, page, row, byte)
    return by_offset


@SETTINGS
@given(layout=st.sampled_from(HOST_LAYOUTS), data=st.data())
def test_host_layouts_match_sglang(host_layouts, layout, data):
    """The byte kvshard's host pool says is (page, layer, token, byte) of the latent, and (page,
    layer, byte) of the indexer, is where SGLang's own host pools put it by each of their
    accessors: ``get_data_page`` (its tensor views), ``get_page_buffer_meta`` (the pointers it
    hands storage backends, with its page sizes) and its transfer kernels' index math (its
    per-layer pointer tables and token strides, as ``backup_from_device_all_layer`` and
    ``load_to_device_per_layer`` hand them to the kernels)."""
    built, ours = host_layouts[layout]
    kv, ix = built.kv, built.indexer
    C = Component
    compared = 0
    for _ in range(8):
        page = data.draw(st.integers(1, kv.page_num - 1))
        layer = data.draw(st.integers(0, kv.layer_num - 1))
        token = data.draw(st.integers(0, PAGE - 1))
        byte = data.draw(st.integers(0, kv.kv_cache_dim - 1))
        draft = layer == kv.target_layer_num
        component, stored = (C.DRAFT_LATENT, 0) if draft else (C.TARGET_LATENT, layer)
        want = _ours(ours, component, stored, page, token, byte)
        view = kv.get_data_page(page * PAGE, flat=False)
        at = {"layer_first": (layer, token, 0, byte), "page_first": (token, layer, 0, byte)}.get(
            layout, (0, layer, token, 0, byte)
        )
        assert _addr(view[at]) == want
        ptrs, sizes = kv.get_page_buffer_meta(torch().arange(page * PAGE, (page + 1) * PAGE))
        if layout == "layer_first":
            assert sizes[layer] == PAGE * kv.kv_cache_dim
            assert ptrs[layer] + token * kv.kv_cache_dim + byte == want
        else:
            assert sizes == [PAGE * kv.layer_num * kv.kv_cache_dim]
            inner = token * kv.layout_dim + layer * kv.kv_cache_dim if layout == "page_first" else (
                layer * PAGE * kv.kv_cache_dim + token * kv.kv_cache_dim
            )
            assert ptrs[0] + inner + byte == want
        slot = page * PAGE + token
        if layout == "page_first_direct":
            # The direct backend moves whole page slabs: kv_buffer[page][layer], token rows in it.
            assert _addr(kv.kv_buffer[page, layer]) + token * kv.token_stride_size + byte == want
        else:
            stride = kv.token_stride_size if layout == "layer_first" else kv.layout_dim
            assert int(kv.data_ptrs[layer]) + slot * stride + byte == want
        compared += 4

        ilayer = data.draw(st.integers(0, ix.layer_num - 1))
        ibyte = data.draw(st.integers(0, ix.indexer_page_stride_size - 1))
        idraft = ilayer == ix.target_layer_num
        component, stored = (C.DRAFT_INDEXER, 0) if idraft else (C.TARGET_INDEXER, ilayer)
        want = _ours(ours, component, stored, page, 0, ibyte)
        iview = ix.get_data_page(page * PAGE, flat=False)
        at = (ilayer, 0, ibyte) if layout == "layer_first" else (0, ilayer, 0, ibyte)
        assert _addr(iview[at]) == want
        if layout == "layer_first":
            assert int(ix.index_k_data_ptrs[ilayer]) + page * ix.indexer_page_stride_size + ibyte == want
        else:
            iptrs, isizes = ix.get_page_buffer_meta(torch().arange(page * PAGE, (page + 1) * PAGE))
            assert isizes == [ix.indexer_layout_dim]
            assert iptrs[0] + ilayer * ix.indexer_page_stride_size + ibyte == want
            # The page-major transfer kernels step pages by indexer_layout_dim.
            base = _addr(ix.index_k_with_scale_buffer)
            assert base + page * ix.indexer_layout_dim + ilayer * ix.indexer_page_stride_size + ibyte == want
        compared += 3
    tally(f"host layout {layout}", 1, compared)


@SETTINGS
@given(shard=st.sampled_from([2, 3, 4]), layout=st.sampled_from(HOST_LAYOUTS), data=st.data())
def test_page_interleave_host_bytes_match_sglang(host_layouts, shard, layout, data):
    """SGLang's ``PageInterleaveHostPool`` over its MLA host pool: a logical host page is its
    owner's local page (``owned_rows``), and the bytes of that local page are where kvshard's
    transfer plan (``TransferPlan.from_slots``, the same narrowing) and its host pool put them."""
    from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec
    from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool

    t = torch()
    built, ours = host_layouts[layout]
    kv = built.kv
    pages = kv.page_num
    logical = data.draw(st.lists(st.integers(shard, shard * pages - 1), min_size=1, max_size=6, unique=True))
    host = t.tensor([h * PAGE + o for h in logical for o in range(PAGE)], dtype=t.int64)
    compared = 0
    for rank in range(shard):
        spec = PageShardSpec(
            shard_rank=rank, shard_size=shard, page_size=PAGE, max_prefix_tokens=shard * PAGE, chunk_tokens=PAGE
        )
        facade = PageInterleaveHostPool(kv, PageInterleavePlacement(spec))
        h_rows, _ = facade.owned_rows(host, host)
        plan = kvshard.hicache.TransferPlan.from_slots(Placement(shard), rank, host.numpy(), host.numpy(), pages, pages)
        assert plan.host_pages == (h_rows[::PAGE] // PAGE).tolist()
        for local in plan.host_pages:
            token = data.draw(st.integers(0, PAGE - 1))
            layer = data.draw(st.integers(0, kv.target_layer_num - 1))
            byte = data.draw(st.integers(0, kv.kv_cache_dim - 1))
            view = facade.get_data_page(local * PAGE, flat=False)
            at = {"layer_first": (layer, token, 0, byte), "page_first": (token, layer, 0, byte)}.get(
                layout, (0, layer, token, 0, byte)
            )
            assert _addr(view[at]) == _ours(ours, Component.TARGET_LATENT, layer, local, token, byte)
            compared += 1
    tally(f"page-interleave host bytes {layout}", 1, compared)
