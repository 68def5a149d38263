"""The capacity planner from Python: the seed's scenario (CP2, 16,384 logical GPU slots, a host
cache 4x larger) gives the figures worked out by hand from the byte layouts, and impossible
inputs raise kvshard's errors."""

import math

import pytest

from kvshard.error import InvalidArgumentError, OutOfMemoryError
from kvshard.geometry import CacheGeometry
from kvshard.pool import plan_capacity

# 61 target layers + the draft, each a 36,864-byte latent block and an 8,448-byte indexer block.
PAGE = 62 * (64 * 576 + 8448)
# One 12,288-token context and a 2,048-token chunk, +64 trash rows; 2 slots x 708 B x 2 (draft).
SCRATCH = (12288 + 2048 + 64) * 2 * 708 * 2


def seed(**kw):
    args = dict(host_factor=4, context_len=12288, chunk_size=2048, contexts=1)
    args.update(kw)
    g = CacheGeometry.deepseek_v32()
    return plan_capacity(g, 2, SCRATCH + 128 * PAGE, 10**10, **args)


def test_the_seed_scenario_matches_the_hand():
    plan = seed(d2d_gbps=2000.0, h2d_gbps=50.0, disk_gbps=5.0, prefixes=[4096])
    slot = math.ceil(PAGE / 4096) * 4096
    assert plan.slot_bytes == slot
    assert plan.budget.scratch_bytes == SCRATCH
    assert plan.budget.logical_capacity == 16384
    gpu, host, disk = plan.tiers
    assert (gpu.tier, gpu.pages_per_rank, gpu.pages, gpu.tokens) == ("gpu", 128, 256, 127 * 128)
    assert (host.tier, host.pages_per_rank, host.bytes) == ("host", 512, 512 * PAGE)
    assert (disk.tier, disk.pages_per_rank, disk.pages) == ("disk", None, 10**10 // slot)
    (r,) = plan.reloads
    assert (r.tokens, r.pages, r.pages_per_rank, r.bytes_per_rank) == (4096, 64, 32, 32 * PAGE)
    l1, l2, l3 = r.tiers
    assert l1.fits and l2.fits and l3.fits
    assert l1.seconds == pytest.approx(32 * PAGE / 2000e9)
    assert l2.seconds == pytest.approx(32 * PAGE / 50e9)
    assert l3.seconds == pytest.approx(64 * slot / 5e9 + 32 * PAGE / 50e9)


def test_unknown_ceilings_and_what_does_not_fit():
    plan = seed()
    assert [r.tokens for r in plan.reloads] == [16384, 131072]
    sixteen = plan.reloads[0]
    # 16K tokens are every logical GPU slot, padding included.
    assert [t.fits for t in sixteen.tiers] == [False, True, True]
    assert all(t.seconds is None for t in sixteen.tiers)


def test_impossible_inputs_raise_kvshard_errors():
    g = CacheGeometry.glm5()
    with pytest.raises(InvalidArgumentError, match="0 ranks"):
        plan_capacity(g, 0, 40 * 10**9, 10**12, host_factor=4)
    with pytest.raises(OutOfMemoryError, match="GPU memory per rank"):
        plan_capacity(g, 2, 10**9, 10**12, host_factor=4)
    with pytest.raises(OutOfMemoryError, match="holds no slot"):
        plan_capacity(g, 2, 40 * 10**9, 10**6, host_factor=4)
    with pytest.raises(InvalidArgumentError, match="exactly one"):
        plan_capacity(g, 2, 40 * 10**9, 10**12, host_factor=4, host_bytes=10**12)
    with pytest.raises(InvalidArgumentError, match="ceiling"):
        plan_capacity(g, 2, 40 * 10**9, 10**12, host_factor=4, h2d_gbps=-1.0)
